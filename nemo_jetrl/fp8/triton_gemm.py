"""Blockwise-scaled FP8 GEMM in Triton: the GPU backend when neither DeepGEMM nor cuBLASLt can run.

``block_fp8_gemm_triton(a, b)`` computes ``a @ b.T`` for ``a`` 1x128-blocked ``[M, K]`` and ``b``
128x128- or 1x128-blocked ``[N, K]`` (`gemm`'s operand convention), reading the FP8 codes and the
fp32 ``scale_inv`` as they are: no dequantized copy of either operand is ever made. Per 128-wide
K tile it takes the fp32 dot ``p`` of the codes and accumulates with TE's (cuBLAS's) order,
``acc = fma(p * sa, sb, acc)``, like `gemm.blockwise_matmul(exact=True)`; only the order inside
the tile's dot differs (tensor cores), so results agree within `gemm`'s stated bound, not bit
for bit.

The dot runs on the FP8 types directly (tensor cores) on SM89+ when both operands have the same
format, and for the hybrid recipe's mixed E5M2 x E4M3 on SM90+ (Hopper's wgmma takes a
different FP8 type per operand; `native_dot`); otherwise (older GPUs, Triton's CPU interpreter
unless ``native=True``) each code is looked up in a 256-entry fp32 table (exact: every FP8 value is an fp32) and the dot runs in TF32 on a
GPU (exact too: FP8 values fit TF32's mantissa and exponent range) or IEEE fp32 in the
interpreter.
The tables are built when the backend is planned (`prepare`), never during a CUDA graph capture.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from nemo_jetrl.fp8._deps import require
from nemo_jetrl.fp8.formats import get_format
from nemo_jetrl.fp8.quantize import BlockQuantized
from nemo_jetrl.fp8.triton_launch import frozen_meta, interpreting, launch


@functools.cache
def _kernel() -> ModuleType:
    require("triton", feature="the Triton FP8 GEMM")
    from nemo_jetrl.fp8 import _triton_gemm_jit

    return _triton_gemm_jit


@functools.cache
def value_table(fmt: str, device: torch.device) -> torch.Tensor:
    """fp32 value of each of the 256 codes of ``fmt`` on ``device`` (built once per device)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes.view(get_format(fmt).dtype).float().to(device)


def native_dot(fmts: tuple[str, str], capability: tuple[int, int]) -> bool:
    """Whether a GPU of ``capability`` takes the FP8 dot of these operand formats directly:
    one format on SM89+, mixed E5M2 x E4M3 on SM90+ (older GPUs use the value tables)."""
    return capability >= ((8, 9) if fmts[0] == fmts[1] else (9, 0))


def _native(a: BlockQuantized, b: BlockQuantized) -> bool:
    if interpreting() or not a.data.is_cuda:
        return False
    return native_dot((a.fmt, b.fmt), torch.cuda.get_device_capability(a.data.device))


def prepare(device: torch.device, fmts: tuple[str, str]) -> None:
    """Build what the kernel reads besides its operands (the value tables) before any capture."""
    for fmt in fmts:
        value_table(fmt, device)


def _check(a: BlockQuantized, b: BlockQuantized, out_dtype: torch.dtype) -> None:
    if a.block != (1, 128) or b.block not in ((1, 128), (128, 128)):
        raise ValueError(
            f"block_fp8_gemm_triton: needs a 1x128 [M, K] and b 1x128 or 128x128 [N, K]; got a "
            f"{a.block} and b {b.block} (pass 128x1 operands as q.t())"
        )
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(
            f"block_fp8_gemm_triton: operands must be 2-D with the same K; got "
            f"{tuple(a.data.shape)} and {tuple(b.data.shape)}"
        )
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"block_fp8_gemm_triton: out_dtype {out_dtype} is not bf16/fp16/fp32")


def pipeline_stages(native: bool) -> int:
    """Software-pipeline depth of the FP8 GEMM kernels. The value-table path stages fp32 tiles,
    4x the FP8 bytes: at 3 stages a 64x128 by 128x128 tile pair needs 296 KB of shared memory
    (H100 has 227 KB; measured on an H100), at 1 stage 96 KB (fits an A100's 164 KB too)."""
    return 3 if native else 1


def _tiles(m: int, native: bool) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages): whole-matrix tiles under the interpreter (fewer programs)."""
    if interpreting():
        return 128, 128, 4, 1
    if native:
        # Hopper's FP8 dot rounds inside the instruction, and a 64-row tile (wgmma) rounds
        # unlike a 16-row one (mma): one tile height for every M keeps a row's bits independent
        # of the batch (seen on an H100: a 1-token expert differed from the grouped kernel's).
        return 64, 128, 4, pipeline_stages(native)
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    return bm, 128, 4, pipeline_stages(native)


@functools.cache
def _meta(b_rows, bm, bn, native, tf32, fmt_a, fmt_b, warps, stages):  # type: ignore[no-untyped-def]
    """The kernel's constexprs and launch options for one configuration, built once."""
    tl = _kernel().tl
    fp8 = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}
    return frozen_meta(
        B_ROWS=b_rows, BM=bm, BN=bn, NATIVE=native, TF32=tf32, FP8_A=fp8[fmt_a],
        FP8_B=fp8[fmt_b], num_warps=warps, num_stages=stages,
    )  # fmt: skip


def block_fp8_gemm_triton(
    a: BlockQuantized,
    b: BlockQuantized,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    native: bool | None = None,
) -> torch.Tensor:
    """``a @ b.T`` in one Triton kernel (see the module docstring); result in ``out_dtype``.

    ``native`` forces the FP8-typed dot (True; also under the interpreter, for tests) or the
    value tables (False); None decides by `native_dot`."""
    _check(a, b, out_dtype)
    jit = _kernel()
    m, k = a.data.shape
    n = b.data.shape[0]
    dev = a.data.device
    # The interpreter's own fp32 -> bf16 conversion truncates: write fp32 there, round in torch.
    store_dtype = torch.float32 if interpreting() else out_dtype
    out = torch.empty(m, n, dtype=store_dtype, device=dev)
    if m and n:
        native = _native(a, b) if native is None else native
        lut_a = a.scale_inv if native else value_table(a.fmt, dev)
        lut_b = b.scale_inv if native else value_table(b.fmt, dev)
        # FP8-typed operands on the tensor-core path (cp.async lands them where wgmma reads
        # them; uint8 codes would go shared -> registers -> bitcast); codes for the tables and
        # the interpreter (numpy has no FP8 type: the kernel bitcasts there)
        typed = native and not interpreting()
        qa, qb = (a.data, b.data) if typed else (a.data.view(torch.uint8), b.data.view(torch.uint8))
        sa, sb = a.scale_inv, b.scale_inv
        bm, bn, warps, stages = _tiles(m, native)
        args = (
            qa, qb, out, sa, sb, lut_a, lut_b, m, n, k,
            qa.stride(0), qa.stride(1), qb.stride(0), qb.stride(1),
            out.stride(0), out.stride(1),
            sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
        )  # fmt: skip
        meta = _meta(b.block[0], bm, bn, native, a.data.is_cuda, a.fmt, b.fmt, warps, stages)
        launch(jit.block_fp8_gemm_kernel, (-(-m // bm), -(-n // bn)), args, meta)
    return out if store_dtype == out_dtype else out.to(out_dtype)
