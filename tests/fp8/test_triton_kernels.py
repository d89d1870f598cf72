"""Triton quantization kernels: bit-exact to `quantize_blockwise` (golden vectors, random inputs).

Without a GPU the kernels run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1 for
the session on CPU-only machines). With a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from triton_setup import BLOCKS, DEVICE, TRITON_MARKS

from nemo_jetrl.fp8 import E4M3, E5M2, fp8_bits, quantize_blockwise

pytestmark = TRITON_MARKS


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _triton(*args, **kwargs):
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

    return quantize_blockwise_triton(*args, **kwargs)


def assert_same(got, want, label=""):
    """Same FP8 bytes, same fp32 scale bits, same shapes and metadata."""
    assert got.data.shape == want.data.shape, label
    assert got.data.dtype == want.data.dtype, label
    assert got.block == want.block and got.fmt == want.fmt, label
    assert got.scale_inv.shape == want.scale_inv.shape, label
    gb, wb = fp8_bits(got.data.cpu().contiguous()), fp8_bits(want.data.cpu().contiguous())
    n_bad = int((gb != wb).sum())
    assert n_bad == 0, f"{label}: {n_bad} of {gb.numel()} FP8 bytes differ"
    gs = got.scale_inv.cpu().contiguous().view(torch.int32)
    ws = want.scale_inv.cpu().contiguous().view(torch.int32)
    assert torch.equal(gs, ws), f"{label}: {int((gs != ws).sum())} scale_inv values differ"


# ------------------------------------------------------------------------------ golden vectors


@pytest.fixture(scope="module")
def golden(golden_dir):
    te = load_file(str(golden_dir / "te_golden_seed0.safetensors"))
    meta = json.loads((golden_dir / "te_golden_seed0.json").read_text())["cases"]
    return te, meta


def test_golden_all_te_cases_bit_exact(golden):
    te, meta = golden
    assert len(meta) == 18
    for case, m in sorted(meta.items()):
        x = te[f"input.{m['input']}"].to(DEVICE)
        block = tuple(m["block"])
        colwise = block == (128, 1)  # golden columnwise is stored transposed: TE's layout
        q = _triton(x, block, pow2_scales=m["pow2"], eps=m["eps"], transpose=colwise)
        want_q, want_s = te[f"{case}.q"], te[f"{case}.scale_inv"]
        assert q.data.shape == want_q.shape, case
        n_bad = int((fp8_bits(q.data.cpu()) != want_q).sum())
        assert n_bad == 0, f"{case}: {n_bad} FP8 bytes differ from TE"
        assert torch.equal(q.scale_inv.cpu().view(torch.int32), want_s.view(torch.int32)), case
        # and the compact layout equals the reference exactly
        if not colwise:
            assert_same(q, quantize_blockwise(x.cpu(), block, pow2_scales=m["pow2"]), case)


# ------------------------------------------------------------------------------ random inputs


def _random_input(shape, dtype, seed):
    """Per-128-group magnitudes 10**U(lo, hi), outliers, exact zeros, zero blocks, ties."""
    g = torch.Generator().manual_seed(seed)
    m, k = shape
    lo, hi = (-5.0, 2.0) if dtype == torch.float16 else (-30.0, 30.0)  # fp16: room for x100
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    groups = -(-k // 128)
    mag = 10.0 ** (lo + (hi - lo) * torch.rand(m, groups, generator=g, dtype=torch.float64))
    x *= mag.repeat_interleave(128, dim=1)[:, :k]
    x[torch.rand(m, k, generator=g) < 0.01] *= 100.0  # outliers
    x[torch.rand(m, k, generator=g) < 0.05] = 0.0
    x[:, : min(k, 128)][: min(m, 40)] = 0.0  # zero 1x128 groups and a mostly-zero 128x128 block
    if dtype != torch.float16 and m > 60:
        # amax 1e-37: scale overflows to finfo.max, scale_inv is subnormal (2.9e-39 / 5.9e-39),
        # which a flush-to-zero division on a GPU would store as +0
        x[50:60] = x[50:60].sign() * torch.rand(10, k, generator=g, dtype=torch.float64) * 1e-37
        x[55, : min(k, 128)] = 0.0
        x[55, 0] = 1e-37
    if m > 130 and k > 130:
        x[128:, 128:256] = 0.0  # a full zero 128x128 block (and 128x1 columns)
    x = x.to(dtype)
    # exact ties for the FP8 rounding: with amax 448 the pow2 scale is 1, these are midpoints
    if m > 45 and k > 10:
        x[45, :10] = torch.tensor(
            [448, 17, -17, 58, 127.5, 3 * 2**-10, 2**-10, -(2**-10), 0.5625, 9]
        )
    return x


CASES = [
    (dtype, fmt, pow2, block)
    for dtype in DTYPES
    for fmt in ("e4m3", "e5m2")
    for pow2 in (True, False)
    for block in BLOCKS
]


@pytest.mark.parametrize(
    ("dtype", "fmt", "pow2", "block"),
    CASES,
    ids=[f"{str(d)[6:]}-{f}-{'pow2' if p else 'fp32'}-{b[0]}x{b[1]}" for d, f, p, b in CASES],
)
def test_random_ragged_bit_exact(dtype, fmt, pow2, block):
    shape = (200, 330) if block != (1, 128) else (70, 330)
    x = _random_input(shape, dtype, seed=hash((str(dtype), fmt, pow2, block)) % 2**31)
    want = quantize_blockwise(x, block, fmt=fmt, pow2_scales=pow2)
    got = _triton(x.to(DEVICE), block, fmt=fmt, pow2_scales=pow2)
    assert_same(got, want, f"{dtype} {fmt} pow2={pow2} {block}")


# 128x1 launches: the GPU's whole tile (run 8's fastest), a 32-row chunked tile at 2 stages, a
# 16-row one at 3, and whole tiles whose transposed output is packed four tokens a word (PACK;
# the sweep's other shapes): a tile is a speed choice and must change no bit.
COLUMN_TILES = [(128, 64, 4), (128, 64, 4, 32, 2), (128, 64, 4, 16, 3), (128, 64, 4, 128, 1, True),
                (128, 128, 8, 128, 1, True)]  # fmt: skip


@pytest.mark.parametrize("tile", COLUMN_TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("transpose", [False, True])
def test_128x1_tiles_give_the_same_bits(monkeypatch, tile, transpose):
    from nemo_jetrl.fp8 import triton_kernels

    monkeypatch.setattr(triton_kernels, "_tile", lambda mode: tile if mode == 2 else (16, 128, 4))
    # 200 tokens: words of 4 where PACK applies; 203: PACK falls back to the byte layout
    for m in (200, 203):
        x = _random_input((m, 330), torch.bfloat16, seed=7)
        want = quantize_blockwise(x, (128, 1), fmt="e4m3", pow2_scales=False)
        got = _triton(x.to(DEVICE), (128, 1), pow2_scales=False, transpose=transpose)
        # transposed: [K, M] data, 1x128 blocks along M (the trainer's WGrad operand)
        assert_same(got, want.t() if transpose else want, f"128x1 tile {tile}, {m} tokens")
        assert got.data.is_contiguous() and got.block == ((1, 128) if transpose else (128, 1))


def test_a_packed_128x1_tile_must_be_128_tokens_tall(monkeypatch):
    # the packed kernel's token permutation is 2 x 4 x 16 rows: another height would write
    # codes to the wrong tokens, so it is refused when the kernel compiles
    from nemo_jetrl.fp8 import triton_kernels

    monkeypatch.setattr(triton_kernels, "_tile", lambda mode: (64, 64, 4, 64, 1, True))
    x = _random_input((200, 330), torch.bfloat16, seed=7)
    with pytest.raises(Exception, match="2 x 4 x 16"):
        _triton(x.to(DEVICE), (128, 1), pow2_scales=False, transpose=True)


def test_every_fp8_rounding_boundary_matches_torch_cast():
    """All midpoints between adjacent FP8 values (and their fp32 neighbours) round like torch."""
    for f in (E4M3, E5M2):
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(f.dtype).float()
        grid = codes[torch.isfinite(codes) & (codes >= 0)].unique().sort().values
        mids = (grid[:-1] + grid[1:]) / 2  # exact in fp32
        pts = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(grid[1:])])
        pts = torch.cat([pts, -pts, torch.tensor([f.fmax])])
        n = pts.numel() // 128 * 128
        x = pts[:n].reshape(-1, 128).clone()
        x[:, 0] = f.fmax  # amax = fmax: pow2 and fp32 scales are exactly 1, values unscaled
        got = _triton(x.to(DEVICE), (1, 128), fmt=f.name)
        assert bool((got.scale_inv == 1).all())
        assert torch.equal(fp8_bits(got.data.cpu()), fp8_bits(x.to(f.dtype)))


@pytest.mark.parametrize("eps", [1e-12, 1.0])
def test_eps_floor_matches_reference(eps):
    x = _random_input((64, 256), torch.bfloat16, seed=3)
    for pow2 in (True, False):
        want = quantize_blockwise(x, (1, 128), pow2_scales=pow2, eps=eps)
        assert_same(_triton(x.to(DEVICE), (1, 128), pow2_scales=pow2, eps=eps), want, str(eps))


def test_nd_input_and_non_contiguous_input():
    x = _random_input((6 * 7, 300), torch.bfloat16, seed=5).reshape(6, 7, 300)
    assert_same(_triton(x.to(DEVICE), (1, 128)), quantize_blockwise(x, (1, 128)), "3-D")
    w = _random_input((260, 300), torch.float32, seed=6)
    wt = w.t()  # strides (1, 300): the kernel reads strided input
    for block in BLOCKS:
        assert_same(_triton(wt.to(DEVICE).t().t(), block), quantize_blockwise(wt, block), "T")


def test_transposed_and_mn_major_layouts():
    x = _random_input((250, 390), torch.bfloat16, seed=7)
    ref_col = quantize_blockwise(x, (128, 1))
    got_t = _triton(x.to(DEVICE), (128, 1), transpose=True)
    assert got_t.data.shape == (390, 250) and got_t.data.is_contiguous()
    assert_same(got_t, ref_col.t(), "transpose")
    got = _triton(x.to(DEVICE), (1, 128), scale_layout="mn_major")
    assert got.scale_inv.stride() == (1, 252)  # M padded to a multiple of 4 (16 bytes)
    assert_same(got, quantize_blockwise(x, (1, 128)), "mn_major")
    with pytest.raises(ValueError, match="only for block"):
        _triton(x.to(DEVICE), (1, 128), transpose=True)
    with pytest.raises(ValueError, match="scale_layout"):
        _triton(x.to(DEVICE), (1, 128), scale_layout="swizzled")


def test_direct_writes_match_the_layout_converters():
    """mn_major == DeepGEMM's SM90 sf layout; its storage == TE's GEMM-ready scale arrays."""
    from nemo_jetrl.fp8 import layouts
    from nemo_jetrl.fp8.triton_kernels import mn_major_storage

    x = _random_input((250, 390), torch.bfloat16, seed=9)
    ref_row, ref_col = quantize_blockwise(x, (1, 128)), quantize_blockwise(x, (128, 1))
    te = layouts.to_te(ref_row, ref_col)
    row = _triton(x.to(DEVICE), (1, 128), scale_layout="mn_major")
    dg = layouts.deepgemm_sf_fp32(ref_row)
    assert row.scale_inv.stride() == dg.stride() and torch.equal(row.scale_inv.cpu(), dg)
    assert torch.equal(mn_major_storage(row.scale_inv).cpu(), te.rowwise_scale_inv)
    col = _triton(x.to(DEVICE), (128, 1), transpose=True, scale_layout="mn_major")
    assert torch.equal(fp8_bits(col.data.cpu()), te.columnwise_data)
    assert torch.equal(mn_major_storage(col.scale_inv).cpu(), te.columnwise_scale_inv)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("block", BLOCKS)
def test_non_finite_raises_the_reference_error(bad, block):
    x = _random_input((150, 260), torch.bfloat16, seed=8)
    x[137, 201] = bad
    with pytest.raises(ValueError) as want:
        quantize_blockwise(x, block, name="layers.3.mlp.up_proj.weight")
    with pytest.raises(ValueError) as got:
        _triton(x.to(DEVICE), block, name="layers.3.mlp.up_proj.weight")
    assert str(got.value) == str(want.value)
    assert "layers.3.mlp.up_proj.weight" in str(got.value) and "[137, 201]" in str(got.value)


def test_unchecked_non_finite_block_has_nan_scale():
    x = torch.ones(4, 256, dtype=torch.bfloat16)
    x[2, 130] = float("nan")
    x[0, 3] = float("inf")
    q = _triton(x.to(DEVICE), (1, 128), check_finite=False)
    nan = torch.isnan(q.scale_inv.cpu())
    assert bool(nan[2, 1]) and bool(nan[0, 0]) and int(nan.sum()) == 2


def test_empty_and_bad_dtype():
    q = _triton(torch.zeros(0, 256, device=DEVICE), (1, 128))
    assert q.data.shape == (0, 256) and q.scale_inv.shape == (0, 2)
    with pytest.raises(TypeError, match="cannot be quantized"):
        _triton(torch.zeros(4, 128, dtype=torch.int32, device=DEVICE), (1, 128))


# ------------------------------------------------------------------------- fused RMSNorm + 1x128


def _rmsnorm64(x, w, eps):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fused_rmsnorm_quantize(dtype, fmt):
    from nemo_jetrl.fp8.triton_kernels import rmsnorm_quantize_1x128

    g = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 23, 330, generator=g) * 4).to(dtype)
    x[0, 0] = 0  # an all-zero row: y = 0, scale 1
    w = (1 + 0.1 * torch.randn(330, generator=g)).to(dtype)
    for pow2 in (True, False):
        y, q = rmsnorm_quantize_1x128(x.to(DEVICE), w.to(DEVICE), norm_eps=1e-5, fmt=fmt,
                                      pow2_scales=pow2)  # fmt: skip
        y = y.cpu()
        assert y.dtype == dtype and y.shape == x.shape
        ref = _rmsnorm64(x, w, 1e-5)
        # one unit in the last place of the output dtype (relative 2**-7 bf16, 2**-10 fp16;
        # absolute ulp * smallest_normal in the subnormal range)
        ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
        bound = ulp * torch.maximum(ref.abs(), torch.tensor(torch.finfo(dtype).smallest_normal))
        err = (y.double() - ref).abs()
        assert bool((err <= bound).all()), float((err - bound).max())
        assert_same(q, quantize_blockwise(y, (1, 128), fmt=fmt, pow2_scales=pow2), "fused")


def test_fused_rmsnorm_rejects_non_finite_with_reference_error():
    from nemo_jetrl.fp8.triton_kernels import rmsnorm_quantize_1x128

    x = torch.randn(5, 256).to(torch.bfloat16)
    x[3, 7] = float("inf")
    with pytest.raises(ValueError, match=r"tensor 'h'.*\[3, 7\]"):
        rmsnorm_quantize_1x128(x.to(DEVICE), torch.ones(256, dtype=torch.bfloat16,
                               device=DEVICE), name="h")  # fmt: skip
    with pytest.raises(ValueError, match=r"weight must have shape \(256,\)"):
        rmsnorm_quantize_1x128(x.to(DEVICE), torch.ones(255, device=DEVICE))


# --------------------------------------------------------------------------------- dispatch


def test_dispatch_backend_argument_selects_triton_and_torch():
    from nemo_jetrl.fp8 import dispatch

    x = _random_input((64, 256), torch.bfloat16, seed=12).to(DEVICE)
    assert dispatch.quant_backend(x, "triton") == "triton"
    assert dispatch.quant_backend(x, "torch") == "torch"
    assert dispatch.quant_backend(x, "auto") == ("triton" if x.is_cuda else "torch")
    a = quantize_blockwise(x, (1, 128), backend="triton")
    b = quantize_blockwise(x, (1, 128), backend="torch")
    assert_same(a, b, "backends")
    with pytest.raises(ValueError, match="use one of"):
        quantize_blockwise(x, (1, 128), backend="cuda")


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    from nemo_jetrl.fp8 import dispatch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="need a CUDA tensor"):
        _triton(torch.ones(2, 128), (1, 128))
    with pytest.raises(RuntimeError, match="cannot run here"):
        dispatch.quant_backend(torch.ones(2, 128), "triton")


# ------------------------------------------------------------------------- source invariants


def test_tiny_amax_keeps_subnormal_scale_inv():
    """amax = 1e-37: 1/scale is subnormal; the reference (and TE) store it, never +0."""
    x = torch.zeros(2, 128)
    x[:, 5] = 1e-37
    for pow2, want in ((False, 1 / torch.finfo(torch.float32).max), (True, 2.0**-127)):
        got = _triton(x.to(DEVICE), (1, 128), pow2_scales=pow2).scale_inv.cpu()
        ref = quantize_blockwise(x, (1, 128), pow2_scales=pow2).scale_inv
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
        assert 0 < float(ref[0, 0]) < torch.finfo(torch.float32).tiny
        assert float(ref[0, 0]) == pytest.approx(want, rel=1e-6)


class _LaunchSpy:
    """Stands in for a jitted kernel: records each launch's keyword arguments, then launches."""

    def __init__(self, kernel, seen: list) -> None:
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_every_quantizer_launch_disables_ftz(monkeypatch):
    """The interpreter never flushes subnormals, so check the launch option itself."""
    import nemo_jetrl.fp8._triton_jit as jit_module
    from nemo_jetrl.fp8.triton_kernels import rmsnorm_quantize_1x128

    seen: list = []
    for name in ("quantize_kernel", "rmsnorm_quantize_kernel"):
        monkeypatch.setattr(jit_module, name, _LaunchSpy(getattr(jit_module, name), seen))
    x = torch.randn(130, 256).to(torch.bfloat16).to(DEVICE)
    for block in BLOCKS:
        _triton(x, block)
    _triton(x, (128, 1), transpose=True, check_finite=False)
    rmsnorm_quantize_1x128(x, torch.ones(256, dtype=torch.bfloat16, device=DEVICE))
    assert len(seen) == 5
    assert all(kw.get("enable_reflect_ftz") is False for kw in seen), seen
    # the option still exists under that name in the installed Triton's CUDA backend
    from triton.backends.nvidia.compiler import CUDAOptions

    assert "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__


def test_kernels_use_ieee_division_only():
    """Triton's fp32 `/` is approximate on NVIDIA GPUs and the interpreter cannot show it.

    Every jitted module: the quantizers, their shared helpers (`_triton_common`) and the GEMMs."""
    import nemo_jetrl.fp8._triton_jit as jit_module

    kernels, text = [], ""
    for mod in ("_triton_jit", "_triton_common", "_triton_gemm_jit", "_triton_grouped_jit"):
        tree = ast.parse((Path(jit_module.__file__).parent / f"{mod}.py").read_text())
        text += ast.unparse(tree)
        kernels += [
            node
            for node in tree.body
            if isinstance(node, ast.FunctionDef)
            and any("jit" in ast.unparse(d) for d in node.decorator_list)
        ]
    assert len(kernels) >= 15
    for fn in kernels:
        divs = [n for n in ast.walk(fn) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)]
        assert not divs, f"{fn.name}: use tl.math.div_rn, not '/' (line {divs[0].lineno})"
    assert "div_rn" in text
