"""Rowwise 1x128 and columnwise 128x1 FP8 from one read of ``x`` (an FP8 linear's x and dy).

A linear's activation ``x`` and gradient ``dy`` are each needed twice per step: 1x128 along K
(FProp / DGrad) and 128x1 along tokens, stored transposed (WGrad). Two quantizer passes read
the input twice; `quantize_rowcol_triton` reads each 128 x 128 tile once and writes both (what
Transformer Engine's ``quantize_transpose_vector_blockwise`` does):

* ``row``: ``quantize_blockwise(x, (1, 128))``: data ``[M, K]``, scale_inv ``[M, ceil(K/128)]``;
* ``col``: ``quantize_blockwise(x, (128, 1)).t()``: data ``[K, M]`` contiguous, block 1x128,
  scale_inv ``[K, ceil(M/128)]`` (TE's columnwise layout).

Both bit-for-bit what the two separate quantizations give (incl. partial tiles, both scale
modes, E4M3/E5M2). ``scale_layout="mn_major"`` writes both scale arrays MN-major with the MN
stride padded to 4 (the GEMM-ready layouts; `triton_kernels.mn_major_storage`). `quantize_rowcol`
picks the Triton kernel or `quantize_rowcol_reference` (pure torch) like `quantize_blockwise`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_jetrl.fp8 import triton_kernels as tk
from nemo_jetrl.fp8 import triton_launch as launch
from nemo_jetrl.fp8.formats import Fp8Format, get_format
from nemo_jetrl.fp8.quantize import INPUT_DTYPES, BlockQuantized, quantize_reference


@dataclass(frozen=True)
class RowcolTile:
    """How the fused kernel is launched over ``x``'s 128 x 128 tiles. Speed only: every tile's
    bits are the same whichever program runs it (`bench_quantizer_bandwidth.py --sweep-tiles`
    times each candidate on a GPU)."""

    warps: int = 8
    """Warps per program (one 128 x 128 tile at a time)."""
    chunk: int = 128
    """Rows quantized at a time: 128 holds the whole tile in registers for both quantizations
    (one read; ~250 registers a thread at 8 warps, so one program per SM); 32 or 64 quantize
    the rows a chunk at a time while the column amax accumulates, then read the tile again
    (from L2) for the columns: a third of the registers, several programs per SM."""
    programs_per_sm: int = 0
    """0: one program per tile (a 8192 x 4096 input: 2048 programs). n > 0: a persistent grid
    of n programs per SM, each looping over tiles."""
    stages: int = 1
    """Software-pipeline depth of the chunk loops (``chunk`` < 128; 1: no overlap): Triton issues
    the next ``stages - 1`` chunks' loads (cp.async into shared memory) before this chunk's math."""

    def __post_init__(self) -> None:
        if self.chunk not in (16, 32, 64, 128) or self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"RowcolTile: chunk {self.chunk} (16, 32, 64 or 128), warps "
                             f"{self.warps} (a power of 2 up to 16)")  # fmt: skip
        if self.programs_per_sm < 0 or self.stages < 1:
            raise ValueError(f"RowcolTile: programs_per_sm {self.programs_per_sm} (>= 0), "
                             f"stages {self.stages} (>= 1)")  # fmt: skip

    def grid(self, tiles: int, sm_count: int) -> int:
        """Programs launched for ``tiles`` tiles on a device of ``sm_count`` SMs."""
        return tiles if not self.programs_per_sm else min(tiles, sm_count * self.programs_per_sm)


ROWCOL_TILE = RowcolTile(warps=8, chunk=128, stages=1)
"""The launch `quantize_rowcol_triton` uses: whole tiles in registers, 8 warps. On the H200
(8192 x 4096, run 8's sweep) it moved 34% of a bf16 copy's bandwidth (36% in run 7), 32-row
chunks pipelined at 2 stages 24% (122 registers, two programs per SM, and still slower), 16
warps 28%. Two separate passes at their own fastest tiles took 32.9 + 41.9 us against this
launch's 107.7 us, so the training linear runs two passes unless ``JETRL_FP8_ROWCOL=fused``
(`linear_plan.ROWCOL_DEFAULT`)."""


def quantize_rowcol_reference(
    x: torch.Tensor,
    *,
    fmt: str | Fp8Format = "e4m3",
    pow2_scales: bool = True,
    eps: float = 0.0,
    name: str | None = None,
    check_finite: bool = True,
) -> tuple[BlockQuantized, BlockQuantized]:
    """``(row, col)`` by the torch reference: two quantizations, ``col`` transposed contiguous."""
    kw = {"fmt": fmt, "pow2_scales": pow2_scales, "eps": eps, "name": name}
    row = quantize_reference(x, (1, 128), check_finite=check_finite, **kw)
    c = quantize_reference(x, (128, 1), check_finite=check_finite, **kw).t()
    col = BlockQuantized(c.data.contiguous(), c.scale_inv, c.block, c.fmt, c.pow2_scales)
    return row, col


def quantize_rowcol_triton(
    x: torch.Tensor,
    *,
    fmt: str | Fp8Format = "e4m3",
    pow2_scales: bool = True,
    eps: float = 0.0,
    name: str | None = None,
    check_finite: bool = True,
    scale_layout: str = "compact",
    native_cast: bool | None = None,
    nonfinite_flag: torch.Tensor | None = None,
) -> tuple[BlockQuantized, BlockQuantized]:
    """``(row, col)`` of 2-D ``x`` in one Triton kernel (see the module docstring).

    ``check_finite``, ``native_cast`` and ``nonfinite_flag`` are `quantize_blockwise_triton`'s:
    the default check raises the reference's error naming the tensor; ``check_finite=False``
    reads nothing on the host (a NaN ``scale_inv`` marks a bad block, and the flag, if given,
    is set on the device). Per call this checks the input and launches; everything that depends
    only on the settings is built once (`triton_launch.launch_meta`)."""
    f = get_format(fmt)
    if x.dim() != 2 or x.dtype not in INPUT_DTYPES or not x.is_cuda:
        _refuse(x, name)
    flag = nonfinite_flag
    bad_flag = flag is not None and (flag.dtype != torch.int32 or flag.numel() < 1)
    if bad_flag or (flag is not None and flag.device != x.device):
        launch._flag_arg(flag, x, _label(name))  # raises naming the tensor
    m, k = x.shape
    mb, kb = -(-m // 128), -(-k // 128)
    row_data = torch.empty(m, k, dtype=f.dtype, device=x.device)
    col_data = torch.empty(k, m, dtype=f.dtype, device=x.device)
    row_s = tk._scale_buffer(m, kb, scale_layout, x.device, kernel_pads=True)
    col_s = tk._scale_buffer(k, mb, scale_layout, x.device, kernel_pads=True)
    # mn_major pads M (row scales) and K (column scales) to 4: the kernel writes those zeros
    # (the padding is < 4 rows/columns, so it always lies in the last, launched tile).
    mp, kp = (m, k) if scale_layout == "compact" else (-(-m // 4) * 4, -(-k // 4) * 4)
    pow2 = bool(pow2_scales)
    if m and k:
        if native_cast is None:
            native = x.is_cuda and launch.native_cast_default(x.device.index or 0)
        else:
            native = bool(native_cast)
        tile = ROWCOL_TILE
        meta = launch.launch_meta(f.name, x.dtype, native, eps, pow2, flag is not None,
                                  tile.warps, CHUNK=tile.chunk, STAGES=tile.stages)  # fmt: skip
        xs = x.stride()
        args = (x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
                row_data.view(torch.uint8), row_s, col_data.view(torch.uint8), col_s,
                row_s if flag is None else flag, m, k, mp, kp, xs[0], xs[1],
                *row_s.stride(), *col_s.stride())  # fmt: skip
        grid = (mb * kb,)  # one program per tile; persistent: a multiple of the SM count
        if tile.programs_per_sm:
            sms = launch.sm_count(x.device) if x.device.type == "cuda" else 1
            grid = (tile.grid(mb * kb, sms),)
        launch.launch(tk._kernels().quantize_rowcol_kernel, grid, args, meta)
        if check_finite and not bool(torch.isfinite(row_s).all()):
            tk._raise_like_reference(x, (1, 128), f, pow2_scales, eps, name)
    row = BlockQuantized(row_data, row_s, (1, 128), f.name, pow2)
    return row, BlockQuantized(col_data, col_s, (1, 128), f.name, pow2)


def _label(name: str | None) -> str:
    return f"quantize_rowcol(tensor {name!r})" if name else "quantize_rowcol"


def _refuse(x: torch.Tensor, name: str | None) -> None:
    """Raise for input the fused kernel does not take (a CPU tensor only under the interpreter)."""
    label = _label(name)
    if x.dim() != 2:
        raise ValueError(f"{label}: needs 2-D input [tokens, features], got {tuple(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{label}: {x.dtype} cannot be quantized (bf16, fp16 or fp32)")
    launch._check_device(x, label)


def quantize_rowcol(
    x: torch.Tensor, *, backend: str | None = None, **kwargs
) -> tuple[BlockQuantized, BlockQuantized]:
    """``(row, col)`` on the backend `dispatch.quantize_blockwise` would pick for ``x``: the
    fused Triton kernel on CUDA (or with ``backend="triton"``), else the torch reference
    (``scale_layout``, ``native_cast`` and ``nonfinite_flag`` are Triton-only and dropped there;
    a given flag is then set from the scales, `finite_flags.note`)."""
    from nemo_jetrl.fp8 import dispatch, finite_flags

    fast = backend != "torch" and (x.is_cuda or backend is not None)
    if fast and dispatch.quant_backend(x, backend) == "triton":
        return quantize_rowcol_triton(x, **kwargs)
    flag = kwargs.pop("nonfinite_flag", None)
    kwargs.pop("scale_layout", None), kwargs.pop("native_cast", None)
    row, col = quantize_rowcol_reference(x, **kwargs)
    if flag is not None:
        finite_flags.note(flag, row.scale_inv)
    return row, col


__all__ = ["quantize_rowcol", "quantize_rowcol_reference", "quantize_rowcol_triton"]
