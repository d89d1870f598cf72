"""Issue 35's fused rowwise+columnwise quantizer kernel, bit for bit.

CPU: the kernel runs under TRITON_INTERPRET=1 (conftest) and is compared bit for bit with two
blockwise quantizations and the torch reference: partial tiles, E4M3/E5M2, pow2/FP32 scales,
strided input, row chunks and persistent grids, MN-major scales (TE's GEMM-ready arrays),
dispatch and errors. The `gpu` test compiles it on every finite bf16 bit pattern.
"""

from __future__ import annotations

import pytest
import torch
from quantizer_cases import MODES, _all_finite_bf16, _input, assert_same
from triton_setup import DEVICE, TRITON_MARKS

from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise
from nemo_jetrl.fp8.rowcol_quantize import (
    quantize_rowcol,
    quantize_rowcol_reference,
    quantize_rowcol_triton,
)

pytestmark = TRITON_MARKS


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


def test_a_rowcol_launch_shape_it_cannot_run_is_refused_by_name():
    from nemo_jetrl.fp8.rowcol_quantize import RowcolTile

    for bad, knob in (({"chunk": 48}, "chunk 48"), ({"warps": 3}, "warps 3"),
                      ({"programs_per_sm": -1}, "programs_per_sm -1"), ({"stages": 0}, "stages 0")):  # fmt: skip
        with pytest.raises(ValueError, match=f"RowcolTile: .*{knob}"):
            RowcolTile(**bad)
    assert RowcolTile(programs_per_sm=2).grid(2048, 132) == 264
    assert RowcolTile().grid(2048, 132) == 2048
