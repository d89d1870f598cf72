"""The grouped expert linear's Triton path against its per-expert torch reference, bit for bit.

Without a GPU the kernels run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1).
Quantizations are compared on random inputs. GEMMs accumulate in TE's per-tile order, the
reference's ``exact_gemm=True`` order; they are compared bit for bit on integer-valued inputs,
where every 128-wide tile's dot of FP8 codes is exact in fp32 (codes are multiples of 2, E5M2
ones of 512, tile sums below 2**25 and 2**32), so any summation order inside a tile gives the
same p and only the scale/accumulation order (FP32 scales included) is under test.
"""

from __future__ import annotations

import pytest
import torch
from triton_setup import DEVICE, TRITON_MARKS

from nemo_jetrl.fp8 import experts, experts_reference, finite_flags, triton_grouped
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.formats import E4M3, E5M2
from nemo_jetrl.fp8.sync_check import no_host_reads

pytestmark = TRITON_MARKS
COUNTS = [129, 0, 1, 127, 128]
CONFIGS = {
    "pow2": Fp8LinearConfig.te_blockwise(exact_gemm=True),
    "fp32_scales": Fp8LinearConfig.te_blockwise_fp32_scales(exact_gemm=True),
    "hybrid": Fp8LinearConfig.te_blockwise_hybrid(exact_gemm=True),
}


def _offsets(counts):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device=DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a, b) -> bool:
    return torch.equal(_bits(a), _bits(b))


def _ints(shape, g, dtype=torch.bfloat16):
    """Integers in [-16, 16] (exact in bf16 and E4M3): tile dots of their codes are exact."""
    return torch.randint(-16, 17, shape, generator=g).to(dtype).to(DEVICE)


@pytest.fixture
def exact_dots(monkeypatch):
    """Value-table dots (exact products, fp32 sums) also on a GPU: Hopper's FP8 tensor cores
    keep fewer accumulator bits inside a tile (`dispatch.GEMM_TOLERANCE`)."""
    monkeypatch.setattr(triton_grouped, "native_dot", lambda fmts, capability: False)


@pytest.fixture
def triton_backend(monkeypatch, exact_dots):
    monkeypatch.setenv(experts.ENV_GROUPED_BACKEND, "triton")
    yield
    finite_flags._FLAGS.clear()


# ------------------------------------------------------------------------------- quantizers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32_scales"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantizers_give_the_reference_bits(fmt, pow2, dtype):
    g = torch.Generator().manual_seed(1)
    offsets = _offsets(COUNTS)
    mag = torch.cat([torch.full((c, 1), 3.1**i) for i, c in enumerate(COUNTS)])
    x = (torch.randn(sum(COUNTS), 256, generator=g) * mag).to(dtype).to(DEVICE)
    kw = {"fmt": fmt, "pow2_scales": pow2, "eps": 0.0, "name": "moe", "what": "input"}
    got, want = (
        triton_grouped.quantize_tokens(x, offsets, **kw),
        experts_reference.quantize_tokens(x, offsets, **kw),
    )
    # codes from 16-aligned columns (COUNTS 129, 0, 1, 127, 128 -> 144, 0, 16, 128, 128), +0
    # codes up to each expert's aligned end; columns past the last are never read
    assert got.token_offsets.tolist() == want.token_offsets.tolist() == [0, 144, 144, 160, 288, 416]
    assert got.data.shape[1] == 464  # ceil16(M + 15 E) = ceil16(385 + 75)
    assert _same(got.data[:, :416], want.data[:, :416]) and _same(got.scale_inv, want.scale_inv)
    pads = [c for e, n in enumerate(COUNTS) for c in range(want.token_offsets[e] + n,
                                                           want.token_offsets[e + 1])]  # fmt: skip
    assert len(pads) == 31 and not bool(got.data[:, pads].view(torch.uint8).any())
    off = offsets.tolist()
    for e in range(len(COUNTS)):  # each expert's operand: its tokens, in order
        ge, we = got.expert(e, off), want.expert(e, off)
        assert ge.data.shape[1] == COUNTS[e] and _same(ge.data, we.data)
    assert torch.equal(got.block_offsets, want.block_offsets)
    assert got.block_offsets.tolist() == [0, 2, 2, 3, 4, 5]
    assert bool((got.scale_inv[:, 5:] == 0).all())  # spare columns
    got, want = (
        triton_grouped.quantize_rows(x, offsets, **kw),
        experts_reference.quantize_rows(x, offsets, **kw),
    )
    assert _same(got.data, want.data) and _same(got.scale_inv, want.scale_inv)
    w = torch.randn(3, 256, 384, generator=g) * torch.tensor([1e-3, 1.0, 40.0])[:, None, None]
    w = w.to(dtype).to(DEVICE)
    kw.pop("what")
    for pair in (False, True):
        (qw, qwt), (rw, rwt) = (
            triton_grouped.quantize_experts(w, pair=pair, **kw),
            experts_reference.quantize_experts(w, **kw),
        )
        assert _same(qw.data, rw.data) and _same(qw.scale_inv, rw.scale_inv)
        assert _same(qwt.data, rwt.data) and _same(qwt.scale_inv, rwt.scale_inv)
        assert qwt.data.shape == (3, 384, 256)


# ------------------------------------------------------------------------------------ GEMMs


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32_scales"])
def test_grouped_gemms_give_the_reference_bits_in_tes_order(exact_dots, pow2):
    g = torch.Generator().manual_seed(2)
    offsets = _offsets(COUNTS)
    m = sum(COUNTS)
    kw = {"pow2_scales": pow2, "eps": 0.0, "name": "moe"}
    x, dy = _ints((m, 256), g), _ints((m, 384), g) * 8
    w = _ints((5, 384, 256), g, torch.float32)
    qx = experts_reference.quantize_rows(x, offsets, fmt=E4M3, what="input", **kw)
    qdy = experts_reference.quantize_rows(dy, offsets, fmt=E5M2, what="grad_output", **kw)
    qw, qwt = experts_reference.quantize_experts(w, fmt=E4M3, **kw)
    _, qwt_pair = triton_grouped.quantize_experts(w, fmt=E4M3, pair=True, **kw)
    cases = [("fprop", qx, qw), ("dgrad_view", qdy, qwt), ("dgrad_pair", qdy, qwt_pair)]
    for label, a, b in cases:
        got = triton_grouped.gemm_rows(a, b, offsets, out_dtype=torch.bfloat16, exact=True)
        want = experts_reference.gemm_rows(a, b, offsets, out_dtype=torch.bfloat16, exact=True)
        assert _same(got, want), label
        assert bool(want.float().abs().sum() > 0)
    qdyc = experts_reference.quantize_tokens(dy, offsets, fmt=E5M2, what="grad_output", **kw)
    qxc = experts_reference.quantize_tokens(x, offsets, fmt=E4M3, what="input", **kw)
    got = triton_grouped.gemm_tokens(qdyc, qxc, offsets, out_dtype=torch.float32, exact=True)
    want = experts_reference.gemm_tokens(qdyc, qxc, offsets, out_dtype=torch.float32, exact=True)
    assert _same(got, want) and bool((got[1] == 0).all()) and bool(got[0].abs().sum() > 0)


# ----------------------------------------------------------------------- the whole function


def _run(x, w, dy, offsets, config):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = experts.grouped_fp8_linear(x, w, offsets, config, "moe")
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_triton_path_gives_the_reference_paths_bits(triton_backend, monkeypatch, key, master):
    g = torch.Generator().manual_seed(3)
    config, offsets, m = CONFIGS[key], _offsets(COUNTS), sum(COUNTS)
    x, w, dy = _ints((m, 128), g), _ints((5, 256, 128), g, master), _ints((m, 256), g)
    got = _run(x, w, dy, offsets, config)
    assert experts.grouped_backend(x) == "triton"
    monkeypatch.setenv(experts.ENV_GROUPED_BACKEND, "torch")
    want = _run(x, w, dy, offsets, config)
    for label, a, b in zip(("y", "dx", "dW"), got, want, strict=True):
        assert a.dtype == b.dtype and _same(a, b), label


def test_triton_path_reads_nothing_on_the_host(triton_backend, monkeypatch):
    """The CUDA behaviour on any device: deferred checks, offsets never read."""
    monkeypatch.setattr(finite_flags, "sync_free", lambda t: True)
    g = torch.Generator().manual_seed(4)
    config, offsets, m = CONFIGS["hybrid"], _offsets(COUNTS), sum(COUNTS)
    x, w, dy = _ints((m, 128), g), _ints((5, 256, 128), g, torch.float32), _ints((m, 256), g)
    want = _run(x, w, dy, offsets, config)  # warm-up: value tables, kernels
    with no_host_reads() as mode:
        got = _run(x, w, dy, offsets, config)
    assert mode.ops_seen > 0
    assert all(_same(a, b) for a, b in zip(got, want, strict=True))
    qw = experts.quantize_expert_weights(w, config, "moe")  # refit: checked, reads the host
    with no_host_reads():
        served = experts.grouped_fp8_linear_inference(x, qw, offsets, config, "moe")
    assert _same(served, got[0])
    finite_flags.check_non_finite()  # all finite
    x[300, 3] = float("nan")  # expert 4 (offsets 0, 129, 129, 130, 257)
    with no_host_reads():
        _run(x, w, dy, offsets, config)
    with pytest.raises(ValueError, match=r"'moe\.expert4\.input'"):
        finite_flags.check_non_finite()


def test_triton_inference_twin_and_named_errors(triton_backend):
    g = torch.Generator().manual_seed(5)
    config, offsets, m = CONFIGS["fp32_scales"], _offsets(COUNTS), sum(COUNTS)
    x, w = _ints((m, 128), g), _ints((5, 256, 128), g, torch.float32)
    qw = experts.quantize_expert_weights(w, config, "moe")
    with torch.no_grad():
        want = experts.grouped_fp8_linear(x, w, offsets, config, "moe")
    assert _same(experts.grouped_fp8_linear_inference(x, qw, offsets, config, "moe"), want)
    if finite_flags.sync_free(x):
        return  # CUDA defers the errors (test above)
    bad = x.clone()
    bad[129, 0] = float("inf")  # expert 2's only token
    with pytest.raises(ValueError, match=r"'moe\.expert2\.input'"):
        experts.grouped_fp8_linear_inference(bad, qw, offsets, config, "moe")
    bad_w = w.clone()
    bad_w[3, 200, 100] = float("nan")
    with pytest.raises(ValueError, match=r"'moe\.expert3\.weight'"):
        experts.grouped_fp8_linear(x, bad_w, offsets, config, "moe")


def test_random_inputs_within_the_gemm_bound_of_float64(monkeypatch):
    """Arbitrary values (tile dots rounded, native FP8 dots where the GPU has them): every
    output within `dispatch.GEMM_TOLERANCE` of the float64 product of the FP8 operands."""
    from nemo_jetrl.fp8.dispatch import GEMM_TOLERANCE as TOL

    monkeypatch.setenv(experts.ENV_GROUPED_BACKEND, "triton")
    g = torch.Generator().manual_seed(6)
    config, offsets, m = CONFIGS["fp32_scales"], _offsets(COUNTS), sum(COUNTS)
    x = torch.randn(m, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(5, 128, 256, generator=g) * 0.05).to(DEVICE)
    dy = torch.randn(m, 128, generator=g).to(torch.bfloat16).to(DEVICE)
    y, dx, dw = _run(x, w, dy, offsets, config)
    kw = {"pow2_scales": False, "eps": 0.0, "name": "moe"}
    qx = experts_reference.quantize_rows(x, offsets, fmt=E4M3, what="input", **kw).dequantize()
    qdy = experts_reference.quantize_rows(dy, offsets, fmt=E4M3, what="g", **kw).dequantize()
    qw = experts_reference.quantize_experts(w, fmt=E4M3, **kw)[0].dequantize()
    xc = experts_reference.quantize_tokens(x, offsets, fmt=E4M3, what="input", **kw)
    dyc = experts_reference.quantize_tokens(dy, offsets, fmt=E4M3, what="g", **kw)
    off = offsets.tolist()
    for e in range(5):
        r = slice(off[e], off[e + 1])
        if r.start == r.stop:
            assert bool((dw[e] == 0).all())
            continue
        a_w, b_w = dyc.expert(e, off).dequantize(), xc.expert(e, off).dequantize()
        for got, a, b in ((y[r], qx[r], qw[e]), (dx[r], qdy[r], qw[e].t()), (dw[e], a_w, b_w)):
            a, b = a.double(), b.double()
            ref = a @ b.t()
            bound = TOL["REL"] * (a.abs() @ b.abs().t()) + TOL["OUT"] * ref.abs()
            err = (got.double() - ref).abs()
            assert bool((err <= bound).all()), f"expert {e}: {float((err - bound).max())}"
    assert bool(dw.abs().sum() > 0)


@pytest.mark.gpu
def test_gpu_grouped_forward_backward_never_syncs():
    """CUDA's own sync detector over a forward + backward on the default (Triton) path."""
    g = torch.Generator().manual_seed(7)
    counts = [300, 0, 1, 500, 129, 46]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device="cuda")
    x = torch.randn(sum(counts), 1024, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(6, 768, 1024, generator=g) * 0.03).cuda()
    dy = torch.randn(sum(counts), 768, generator=g).to(torch.bfloat16).cuda()
    config = CONFIGS["hybrid"]
    assert experts.grouped_backend(x) == "triton"
    _run(x, w, dy, offsets, config)  # compiles outside the detector
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        *_, dw = _run(x, w, dy, offsets, config)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    finite_flags.check_non_finite()
    assert bool(torch.isfinite(dw).all()) and bool((dw[1] == 0).all())
