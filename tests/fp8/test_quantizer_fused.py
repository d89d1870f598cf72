"""Issue 35's quantizer: fused rowwise+columnwise kernel, the flag in the kernel, hardware cast.

CPU: the kernels run under TRITON_INTERPRET=1 (conftest) and are compared bit for bit with the
torch reference. The interpreter's own FP8 conversion does not round to nearest-even, so the
hardware-cast path (``native_cast=True``) is checked on CPU only where it cannot differ (scales,
signs, the flag, the launch options); its codes are compared with the software encode on every
finite bf16 bit pattern by the `gpu` tests at the end.
"""

from __future__ import annotations

import pytest
import torch
from fp8_inventory import Inventory, record_triton
from triton_setup import BLOCKS, DEVICE, TRITON_MARKS

from nemo_jetrl.fp8 import finite_flags, fp8_bits, quantize_blockwise
from nemo_jetrl.fp8.rowcol_quantize import (
    quantize_rowcol,
    quantize_rowcol_reference,
    quantize_rowcol_triton,
)

pytestmark = TRITON_MARKS
MODES = [(f, p) for f in ("e4m3", "e5m2") for p in (True, False)]


def _input(m, k, dtype, seed):
    """Per-group magnitudes over 60 decades, outliers, zeros, a zero column block, tiny amax."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    x *= 10.0 ** (-30 + 60 * torch.rand(m, 1, generator=g, dtype=torch.float64))
    x *= 10.0 ** (-3 + 6 * torch.rand(1, k, generator=g, dtype=torch.float64))
    x[torch.rand(m, k, generator=g) < 0.01] *= 100.0
    x[torch.rand(m, k, generator=g) < 0.05] = 0.0
    x[:, : min(k, 3)] = 0.0  # all-zero 128x1 columns
    if m > 20:
        x[10:20] = x[10:20].sign() * 1e-37  # scale overflows to finfo.max: subnormal scale_inv
    return x.to(dtype)


def _bits(q):
    return fp8_bits(q.data.cpu().contiguous()), q.scale_inv.cpu().contiguous().view(torch.int32)


def assert_same(got, want, label):
    assert got.data.shape == want.data.shape and got.block == want.block, label
    assert got.fmt == want.fmt and got.scale_inv.shape == want.scale_inv.shape, label
    (gd, gs), (wd, ws) = _bits(got), _bits(want)
    assert torch.equal(gd, wd), f"{label}: {int((gd != wd).sum())} FP8 bytes differ"
    assert torch.equal(gs, ws), f"{label}: {int((gs != ws).sum())} scale_inv values differ"


# ------------------------------------------------------------ fused rowwise + columnwise kernel

SHAPES = [(200, 330), (128, 256), (1, 128), (129, 127), (300, 130)]


@pytest.mark.parametrize(("fmt", "pow2"), MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{k}" for m, k in SHAPES])
def test_rowcol_equals_two_quantizations(shape, fmt, pow2):
    x = _input(*shape, torch.bfloat16, seed=shape[0] * 7 + shape[1])
    row, col = quantize_rowcol_triton(x.to(DEVICE), fmt=fmt, pow2_scales=pow2)
    assert col.data.shape == (shape[1], shape[0]) and col.data.is_contiguous()
    assert row.data.is_contiguous()
    assert_same(row, quantize_blockwise(x, (1, 128), fmt=fmt, pow2_scales=pow2), "row")
    want_col = quantize_blockwise(x, (128, 1), fmt=fmt, pow2_scales=pow2).t()
    assert_same(col, want_col, "col")
    ref_row, ref_col = quantize_rowcol_reference(x, fmt=fmt, pow2_scales=pow2)
    assert_same(row, ref_row, "reference row")
    assert_same(col, ref_col, "reference col")
    assert ref_col.data.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rowcol_other_input_dtypes_and_eps(dtype):
    x = _input(140, 260, dtype, seed=4)
    if dtype == torch.float16:
        x = x.float().clamp(-6e4, 6e4).to(dtype)
    for eps in (0.0, 1e-3):
        row, col = quantize_rowcol_triton(x.to(DEVICE), pow2_scales=False, eps=eps)
        assert_same(row, quantize_blockwise(x, (1, 128), pow2_scales=False, eps=eps), "row")
        want = quantize_blockwise(x, (128, 1), pow2_scales=False, eps=eps).t()
        assert_same(col, want, "col")


def test_rowcol_strided_input():
    x = _input(260, 200, torch.bfloat16, seed=5)
    xt = x.t().contiguous().t()  # strides (1, 260)
    row, col = quantize_rowcol_triton(xt.to(DEVICE))
    assert_same(row, quantize_blockwise(x, (1, 128)), "row")
    assert_same(col, quantize_blockwise(x, (128, 1)).t(), "col")


ROWCOL_LAUNCHES = [(4, 128, 1, 1), (4, 32, 2, 2), (2, 16, 3, 3), (8, 64, 0, 2), (8, 32, 0, 1)]


@pytest.mark.parametrize(
    ("warps", "chunk", "programs_per_sm", "stages"), ROWCOL_LAUNCHES,
    ids=[f"w{w}-c{c}-p{p}-s{s}" for w, c, p, s in ROWCOL_LAUNCHES],
)  # fmt: skip
def test_every_rowcol_launch_gives_every_tile_the_same_bits(monkeypatch, warps, chunk,
                                                            programs_per_sm, stages):  # fmt: skip
    """Row chunks (the column amax a max over chunks, the tile read again for the columns) and
    persistent grids (fewer programs than tiles, each looping) write the bits of whole tiles,
    one program each: partial tiles, mn_major padding, a non-finite tile that a later iteration
    of a program meets (flag set, NaN scales), strided input."""
    from nemo_jetrl.fp8 import rowcol_quantize, triton_kernels

    x = _input(300, 390, torch.bfloat16, seed=11)  # 3 x 4 tiles, the last row and column partial
    x[260, 300] = float("inf")  # tile (2, 2): the 11th of 12
    monkeypatch.setattr(rowcol_quantize, "ROWCOL_TILE", rowcol_quantize.RowcolTile())
    want = quantize_rowcol_triton(x.to(DEVICE), check_finite=False, scale_layout="mn_major")
    launched: list = []
    real = triton_kernels._kernels

    class Spy:  # records the grid, launches the real kernel
        def __getitem__(self, grid):
            launched.append(grid)
            return real().quantize_rowcol_kernel[grid]

    tile = rowcol_quantize.RowcolTile(warps, chunk, programs_per_sm, stages)
    monkeypatch.setattr(rowcol_quantize, "ROWCOL_TILE", tile)
    monkeypatch.setattr(triton_kernels, "_kernels", lambda: type("K", (), {
        "quantize_rowcol_kernel": Spy()})())  # fmt: skip
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    xt = x.t().contiguous().t().to(DEVICE)  # strides (1, 300)
    got = quantize_rowcol_triton(xt, check_finite=False, scale_layout="mn_major",
                                 nonfinite_flag=flag)  # fmt: skip
    sms = 1 if DEVICE == "cpu" else torch.cuda.get_device_properties(0).multi_processor_count
    programs = min(12, sms * programs_per_sm) if programs_per_sm else 12
    assert launched and all(g == (programs,) for g in launched), launched
    assert int(flag[0]) == 1
    for g, w, which in zip(got, want, ("row", "col"), strict=True):
        assert_same(g, w, which)
        gs, ws = g.scale_inv.cpu(), w.scale_inv.cpu()
        assert torch.equal(gs.isnan(), ws.isnan()) and bool(gs.isnan().any()), which
        assert torch.equal(mn_major_storage_bits(g), mn_major_storage_bits(w)), which


def mn_major_storage_bits(q):
    from nemo_jetrl.fp8.triton_kernels import mn_major_storage

    return mn_major_storage(q.scale_inv).cpu().view(torch.int32)


def test_rowcol_mn_major_scales_are_the_gemm_ready_layouts(monkeypatch):
    """Both scale arrays in TE's GEMM-ready padded layout, the padding zeros written by the
    kernel (the buffers come NaN-filled here: no fill kernel is relied on)."""
    from nemo_jetrl.fp8 import layouts
    from nemo_jetrl.fp8 import triton_kernels as tk
    from nemo_jetrl.fp8.triton_kernels import mn_major_storage

    real = tk._scale_buffer

    def garbage(*args, **kwargs):
        s = real(*args, **kwargs)
        if s.stride(0) == 1:  # mn_major: NaN over the whole padded storage
            s.as_strided((s.shape[1], s.stride(1)), (s.stride(1), 1)).fill_(float("nan"))
        return s

    monkeypatch.setattr(tk, "_scale_buffer", garbage)
    x = _input(250, 390, torch.bfloat16, seed=9)
    row, col = quantize_rowcol_triton(x.to(DEVICE), scale_layout="mn_major")
    assert row.scale_inv.stride() == (1, 252) and col.scale_inv.stride() == (1, 392)
    ref_row, ref_col = quantize_blockwise(x, (1, 128)), quantize_blockwise(x, (128, 1))
    assert_same(row, ref_row, "row")
    assert_same(col, ref_col.t(), "col")
    te = layouts.to_te(ref_row, ref_col)
    assert torch.equal(mn_major_storage(row.scale_inv).cpu(), te.rowwise_scale_inv)
    assert torch.equal(fp8_bits(col.data.cpu()), te.columnwise_data)
    assert torch.equal(mn_major_storage(col.scale_inv).cpu(), te.columnwise_scale_inv)


def test_rowcol_dispatch_picks_reference_on_cpu_and_triton_when_asked():
    x = _input(130, 256, torch.bfloat16, seed=6)
    a = quantize_rowcol(x, name="h")  # CPU tensor, no backend: the reference
    b = quantize_rowcol(x.to(DEVICE), backend="triton", name="h")
    for got, want in zip(b, a, strict=True):
        assert_same(got, want, "dispatch")
    flag = torch.zeros(1, dtype=torch.int32)
    x[3, 3] = float("inf")
    quantize_rowcol(x, check_finite=False, nonfinite_flag=flag)  # reference path sets it too
    assert int(flag) == 1


def test_rowcol_errors_name_the_tensor():
    x = _input(150, 260, torch.bfloat16, seed=8)
    x[137, 201] = float("nan")
    with pytest.raises(ValueError) as want:
        quantize_blockwise(x, (1, 128), name="blk.grad_output")
    with pytest.raises(ValueError) as got:
        quantize_rowcol_triton(x.to(DEVICE), name="blk.grad_output")
    assert str(got.value) == str(want.value) and "blk.grad_output" in str(got.value)
    with pytest.raises(ValueError, match="needs 2-D input"):
        quantize_rowcol_triton(x.reshape(2, 75, 260).to(DEVICE))
    with pytest.raises(TypeError, match="cannot be quantized"):
        quantize_rowcol_triton(torch.zeros(4, 128, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="nonfinite_flag must be an int32"):
        quantize_rowcol_triton(x.to(DEVICE), nonfinite_flag=torch.zeros(1, device=DEVICE))
    row, col = quantize_rowcol_triton(torch.zeros(0, 256, device=DEVICE))
    assert row.data.shape == (0, 256) and col.data.shape == (256, 0)


# --------------------------------------------------------------------- the flag in the kernel


def _quantizers():
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton, rmsnorm_quantize_1x128

    calls = {f"{b[0]}x{b[1]}": (lambda x, b=b, **kw: quantize_blockwise_triton(x, b, **kw))
             for b in BLOCKS}  # fmt: skip
    calls["128x1-transposed"] = lambda x, **kw: quantize_blockwise_triton(
        x, (128, 1), transpose=True, **kw
    )
    calls["rowcol"] = quantize_rowcol_triton
    calls["rmsnorm"] = lambda x, **kw: rmsnorm_quantize_1x128(
        x, torch.ones(x.shape[-1], dtype=x.dtype, device=x.device), **kw
    )
    return calls


@pytest.mark.parametrize("which", sorted(_quantizers()))
@pytest.mark.parametrize("native", [False, True])
def test_kernel_sets_the_flag_only_for_non_finite_input(which, native):
    quantize = _quantizers()[which]
    x = _input(200, 300, torch.bfloat16, seed=12).to(DEVICE)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    quantize(x, check_finite=False, nonfinite_flag=flag, native_cast=native)
    assert int(flag) == 0, which
    for r, c, bad in ((199, 299, float("nan")), (0, 0, float("inf")), (130, 5, float("-inf"))):
        y = x.clone()
        y[r, c] = bad
        flag.zero_()
        quantize(y, check_finite=False, nonfinite_flag=flag, native_cast=native)
        assert int(flag) == 1, (which, r, c)


@pytest.fixture
def counted(monkeypatch):
    from nemo_jetrl.fp8 import triton_kernels

    if not triton_kernels.interpreting():
        pytest.skip("counts interpreter launches on CPU tensors")
    inventory = Inventory()
    record_triton(monkeypatch, inventory)
    finite_flags._FLAGS.clear()
    yield inventory
    finite_flags._FLAGS.clear()


def _deferred_old(x, block, name):
    """The deferred quantization of the tree before issue 35 (linear._quantize): quantize
    unchecked, then `finite_flags.record` (isnan + any (+ logical_or) on the scales)."""
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

    q = quantize_blockwise_triton(x, block, check_finite=False, name=name)
    finite_flags.record(name, q.scale_inv)


def _deferred_new(x, block, name):
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

    flag = finite_flags.flag(name, x.device)
    quantize_blockwise_triton(x, block, check_finite=False, name=name, nonfinite_flag=flag)


def _deferred_rowcol(x, block, name):
    quantize_rowcol(x, backend="triton", check_finite=False, nonfinite_flag=finite_flags.flag(
        name, x.device))  # fmt: skip


def _launches_of_second_call(counted, run):
    x = _input(130, 256, torch.bfloat16, seed=2)
    run(x, (1, 128), "blk.input")  # the first step allocates the flag (once per run)
    finite_flags.check_non_finite()
    counted.ops.clear()
    with counted:
        run(x, (1, 128), "blk.input")
    finite_flags.check_non_finite()  # finite: no error
    return counted.launches()


@pytest.mark.parametrize("how", ["quantize_kernel", "quantize_rowcol_kernel"])
def test_one_deferred_quantization_is_one_kernel(counted, how):
    """Kernels of one sync-free quantization after its first step: the quantizer, nothing else
    (no isnan/any/logical_or flag kernels, no fills)."""
    run = _deferred_new if how == "quantize_kernel" else _deferred_rowcol
    launches = _launches_of_second_call(counted, run)
    assert launches == [f"triton:{how}"], launches


def test_the_inventory_sees_the_old_flag_kernels(counted):
    """The same count on the pattern every deferred quantization used before issue 35
    (quantize, then `finite_flags.record`): its separate flag kernels show, so the test above
    fails on it."""
    launches = _launches_of_second_call(counted, _deferred_old)
    assert launches[0] == "triton:quantize_kernel" and {"isnan", "any"} <= set(launches[1:])


def test_flag_buffers_are_reused_and_the_error_names_the_tensor():
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

    finite_flags._FLAGS.clear()
    finite_flags._SPARE.clear()
    x = _input(130, 256, torch.bfloat16, seed=3).to(DEVICE)
    f1 = finite_flags.flag("blk.input", x.device)
    assert finite_flags.flag("blk.input", x.device) is f1 and finite_flags.pending() == 1
    quantize_blockwise_triton(x, (1, 128), check_finite=False, nonfinite_flag=f1)
    finite_flags.check_non_finite()
    assert finite_flags.pending() == 0
    f2 = finite_flags.flag("blk.input", x.device)
    assert f2 is f1 and int(f2) == 0  # the same buffer, zeroed after the read
    x[5, 7] = float("nan")
    quantize_blockwise_triton(x, (128, 1), check_finite=False, nonfinite_flag=f2)
    finite_flags.record("blk.grad_output", torch.ones(2, 2, device=DEVICE))  # finite
    with pytest.raises(ValueError, match=r"FP8 operand\(s\) \['blk.input'\]"):
        finite_flags.check_non_finite()
    assert int(finite_flags.flag("blk.input", x.device)) == 0
    finite_flags.check_non_finite()
    finite_flags._SPARE.clear()


# ------------------------------------------------------------------------------- hardware cast


def test_native_cast_default_rule(monkeypatch):
    """The default: hardware cast for CUDA tensors on SM89+ in compiled kernels, never under the
    interpreter; JETRL_FP8_NATIVE_CAST=0 turns it off. (The device query is faked: no GPU.)"""
    from nemo_jetrl.fp8 import triton_kernels as tk

    x = torch.zeros(1)
    assert tk.resolve_native_cast(x, None) is False
    assert tk.resolve_native_cast(x, True) is True and tk.resolve_native_cast(x, False) is False
    for cap, env, want in (((9, 0), None, True), ((8, 9), "1", True), ((8, 0), None, False),
                           ((9, 0), "0", False), ((10, 0), None, True)):  # fmt: skip
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i, cap=cap: cap)
        if env is None:
            monkeypatch.delenv(tk.ENV_NATIVE_CAST, raising=False)
        else:
            monkeypatch.setenv(tk.ENV_NATIVE_CAST, env)
        tk._native_cast_on.cache_clear()
        assert tk._native_cast_on(0) is want, (cap, env)
    monkeypatch.setenv(tk.ENV_NATIVE_CAST, "yes")
    tk._native_cast_on.cache_clear()
    with pytest.raises(ValueError, match="JETRL_FP8_NATIVE_CAST is 'yes'; use 0 or 1"):
        tk._native_cast_on(0)
    tk._native_cast_on.cache_clear()


@pytest.mark.parametrize("which", sorted(_quantizers()))
def test_native_path_runs_and_only_its_codes_can_differ_here(which):
    """Under the interpreter the hardware path's codes are the interpreter's (not RNE); its
    scales and signs are the software path's bit for bit (the cast touches neither)."""
    quantize = _quantizers()[which]
    x = _input(200, 300, torch.bfloat16, seed=13).to(DEVICE)
    soft = quantize(x, native_cast=False)
    hard = quantize(x, native_cast=True)
    soft = soft if isinstance(soft, tuple) else (soft,)
    hard = hard if isinstance(hard, tuple) else (hard,)
    for s, h in zip(soft, hard, strict=True):
        if isinstance(s, torch.Tensor):  # rmsnorm's y
            assert torch.equal(s, h)
            continue
        (sd, ss), (hd, hs) = _bits(s), _bits(h)
        assert torch.equal(ss, hs), which
        assert torch.equal(sd & 0x80, hd & 0x80), which
        if DEVICE == "cuda":
            assert torch.equal(sd, hd), which


def test_every_rowcol_launch_disables_ftz(monkeypatch):
    import nemo_jetrl.fp8._triton_jit as jit_module

    seen: list = []
    kernel = jit_module.quantize_rowcol_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs)
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(jit_module, "quantize_rowcol_kernel", Spy())
    quantize_rowcol_triton(torch.ones(130, 256, device=DEVICE), check_finite=False)
    assert len(seen) == 1 and seen[0].get("enable_reflect_ftz") is False


# ------------------------------------------------------------------------------------- GPU tier


def _all_finite_bf16(layout):
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[torch.isfinite(x)]  # 65280 patterns (+-inf and NaNs removed)
    if layout == "shuffled":  # blocks mixing every magnitude: subnormal codes, zero codes
        x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    else:  # sorted: blocks of neighbouring patterns (every amax exponent, ties inside)
        x = x.sort().values
    return x.reshape(-1, 128)  # [510, 128]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["sorted", "shuffled"])
@pytest.mark.parametrize("block", BLOCKS, ids=["1x128", "128x128", "128x1"])
def test_gpu_hardware_cast_equals_software_encode_on_every_finite_bf16(block, layout):
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

    x = _all_finite_bf16(layout)
    for src in (x, x.t().contiguous()):  # each pattern in rows and in columns of blocks
        xc = src.cuda()
        for fmt, pow2 in MODES:
            kw = {"fmt": fmt, "pow2_scales": pow2}
            soft = quantize_blockwise_triton(xc, block, native_cast=False, **kw)
            hard = quantize_blockwise_triton(xc, block, native_cast=True, **kw)
            default = quantize_blockwise_triton(xc, block, **kw)
            want = quantize_blockwise(src, block, **kw)
            for got, label in ((soft, "soft"), (hard, "hard"), (default, "default")):
                assert_same(got, want, f"{label} {fmt} pow2={pow2} {block} {layout}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["sorted", "shuffled"])
def test_gpu_rowcol_on_every_finite_bf16_and_random(layout):
    for x in (_all_finite_bf16(layout), _input(1000, 4100, torch.bfloat16, seed=1)):
        for fmt, pow2 in MODES:
            kw = {"fmt": fmt, "pow2_scales": pow2}
            for native in (None, False):
                row, col = quantize_rowcol_triton(x.cuda(), native_cast=native, **kw)
                assert_same(row, quantize_blockwise(x, (1, 128), **kw), f"row {fmt} {pow2}")
                want = quantize_blockwise(x, (128, 1), **kw).t()
                assert_same(col, want, f"col {fmt} {pow2}")


@pytest.mark.gpu
def test_gpu_flagged_quantization_in_a_cuda_graph():
    """The sync-free path is capturable: the kernel's flag is set on replay with NaN input."""
    x = _input(256, 4096, torch.bfloat16, seed=2).cuda()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    kw = {"check_finite": False, "nonfinite_flag": flag}
    quantize_rowcol_triton(x, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantize_rowcol_triton(x, **kw)
    graph.replay()
    assert int(flag) == 0
    x[100, 1000] = float("nan")
    graph.replay()
    assert int(flag) == 1


def test_a_rowcol_launch_shape_it_cannot_run_is_refused_by_name():
    from nemo_jetrl.fp8.rowcol_quantize import RowcolTile

    for bad, knob in (({"chunk": 48}, "chunk 48"), ({"warps": 3}, "warps 3"),
                      ({"programs_per_sm": -1}, "programs_per_sm -1"), ({"stages": 0}, "stages 0")):  # fmt: skip
        with pytest.raises(ValueError, match=f"RowcolTile: .*{knob}"):
            RowcolTile(**bad)
    assert RowcolTile(programs_per_sm=2).grid(2048, 132) == 264
    assert RowcolTile().grid(2048, 132) == 2048
