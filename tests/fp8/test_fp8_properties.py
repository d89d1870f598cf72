"""Property tests: `quantize_blockwise` on fresh random inputs vs the float64 spec in fp8_reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from fp8_reference import reference_quantize, round_float64

from nemo_jetrl.fp8 import BLOCKS, quantize_blockwise

SHAPES = [(1, 128), (3, 200), (130, 140), (256, 256)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LOG10_RANGE = {torch.bfloat16: (-38, 30), torch.float16: (-4, 3), torch.float32: (-38, 30)}


def _random_input(shape, dtype, seed):
    """Gaussian rows/blocks with magnitudes 1e-30..1e30 (fp16: its range), zero blocks, outliers."""
    g = torch.Generator().manual_seed(seed)
    m, k = shape
    lo, hi = LOG10_RANGE[dtype]
    lo = max(lo, -30) if seed % 3 else lo  # some cases go below 1e-36: 448/amax overflows fp32
    mag = 10 ** (torch.rand(m, 1, generator=g) * (hi - lo) + lo)
    col = 10 ** (torch.rand(1, -(-k // 128), generator=g) * 4 - 2).repeat_interleave(128, 1)[:, :k]
    x = torch.randn(m, k, generator=g, dtype=torch.float64) * mag * col
    if m * k > 128:
        x[: min(m, 128), :128] = 0  # an all-zero block in every block shape
        i, j = int(torch.randint(m, (1,), generator=g)), int(torch.randint(k, (1,), generator=g))
        x[i, j] = x[i, j] * 1e4 if dtype != torch.float16 else 6e4  # single outlier
    big = float(torch.finfo(dtype).max) / 4
    return x.clamp(-big, big).to(dtype)


CASES = list(itertools.product(BLOCKS, ("e4m3", "e5m2"), (True, False)))


def _check_against_spec(block, fmt, pow2, shapes, seed0):
    seed = seed0
    for shape, dtype, eps in itertools.product(shapes, DTYPES, (0.0, 1e-3)):
        if shape[0] * shape[1] > 40_000 and (eps or dtype != torch.bfloat16):
            continue  # keep the runtime small: big shapes once per case
        seed += 1
        x = _random_input(shape, dtype, seed)
        q = quantize_blockwise(x, block, fmt=fmt, pow2_scales=pow2, eps=eps)
        want_q, want_sinv = reference_quantize(x, block, fmt, pow2, eps)
        label = f"{shape} {dtype} eps={eps}"
        assert q.scale_inv.dtype == torch.float32
        assert torch.equal(q.scale_inv.double(), want_sinv), label
        got = q.data.double()
        assert torch.equal(got, want_q), f"{label}: {int((got != want_q).sum())} values differ"
        assert torch.equal(torch.signbit(got), torch.signbit(want_q)), label


@pytest.mark.parametrize(("block", "fmt", "pow2"), CASES)
def test_matches_float64_spec(block, fmt, pow2):
    _check_against_spec(block, fmt, pow2, SHAPES, 100 * CASES.index((block, fmt, pow2)))


@pytest.mark.slow
@pytest.mark.parametrize(("block", "fmt", "pow2"), CASES)
def test_matches_float64_spec_more_seeds_and_shapes(block, fmt, pow2):
    shapes = [(2, 1000), (129, 257), (384, 640), (1000, 130)]
    for rep in range(3):
        _check_against_spec(
            block, fmt, pow2, shapes, 10_000 * (rep + 1) + CASES.index((block, fmt, pow2))
        )


def test_reference_rounding_is_not_vacuous():
    """The hand-written RNE hits ties-to-even and saturation exactly as IEEE says."""
    e4m3 = (4, -6, 448.0)
    v = torch.tensor(
        [1.0625, 1.1875, 464.0, 1e9, -(2.0**-10), 2.0**-10 * 3, 0.0], dtype=torch.float64
    )
    want = torch.tensor([1.0, 1.25, 448.0, 448.0, -0.0, 2.0**-9 * 2, 0.0], dtype=torch.float64)
    got = round_float64(v, e4m3, saturate=True)
    assert torch.equal(got, want) and bool(torch.signbit(got[4]))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("block", BLOCKS)
def test_dequantize_error_bound(fmt, block):
    """|deq - x| <= u*|x| + (half the smallest subnormal) * scale_inv, u the format's roundoff."""
    u, half_sub = {"e4m3": (2.0**-4, 2.0**-10), "e5m2": (2.0**-3, 2.0**-17)}[fmt]
    x = _random_input((256, 256), torch.bfloat16, seed=7)
    q = quantize_blockwise(x, block, fmt=fmt, pow2_scales=False)
    bm, bk = block
    sinv = q.scale_inv.double().repeat_interleave(bm, 0)[:256].repeat_interleave(bk, 1)[:, :256]
    err = (q.dequantize(torch.float64) - x.double()).abs()
    bound = (u * x.double().abs() + half_sub * sinv) * (1 + 2.0**-20)
    assert bool((err <= bound).all())
    assert float(err.max()) > 0  # lossy, so the bound is being exercised


def test_nd_input_for_1x128():
    x = _random_input((6, 200), torch.bfloat16, seed=3).reshape(2, 3, 200)
    q = quantize_blockwise(x, (1, 128))
    flat = quantize_blockwise(x.reshape(6, 200), (1, 128))
    assert q.data.shape == (2, 3, 200) and q.scale_inv.shape == (2, 3, 2)
    assert torch.equal(q.data.view(torch.uint8).reshape(6, 200), flat.data.view(torch.uint8))
    assert torch.equal(q.scale_inv.reshape(6, 2), flat.scale_inv)
    assert torch.equal(q.dequantize().reshape(6, 200), flat.dequantize())
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise(x, (128, 128))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("block", BLOCKS)
def test_non_finite_input_names_tensor_and_first_block(bad, block):
    x = torch.randn(300, 400).to(torch.bfloat16)
    x[290, 390] = bad  # a later block
    x[140, 260] = bad  # the first bad block in row-major block order
    bm, bk = block
    first = (140 // bm, 260 // bk)
    with pytest.raises(ValueError) as info:
        quantize_blockwise(x, block, name="layers.3.mlp.up_proj.weight")
    msg = str(info.value)
    assert "'layers.3.mlp.up_proj.weight'" in msg
    assert f"block {first}" in msg and "[140, 260]" in msg and "2 block(s)" in msg
