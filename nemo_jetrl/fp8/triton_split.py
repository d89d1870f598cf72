"""The ``triton_splitk`` FP8 GEMM: split-K for decode, with a row's bits independent of the batch.

``split_gemm(a, b)`` computes ``a @ b.T`` (`gemm`'s operand convention: ``a`` 1x128 ``[M, K]``,
``b`` 128x128 or 1x128 ``[N, K]``) in the fixed split order of `split_order`: K is cut into
chunks of 8 scale tiles, each chunk summed in TE's per-tile order, the chunk sums added left to
right. Two launch modes give the same bits for every element:

* **split** (M <= `SPLIT_MAX_M`, the decode sizes): one program per (64 weight rows, token
  tile, chunk), each writing its chunk's partial; the tile's last program to finish (a counter
  per tile, `prepare`) adds the partials in chunk order and casts: one launch. The weight is
  read by ``ceil(N/64) * chunks`` programs at once (K = 4096, N = 4096: 256 programs), which is
  what a memory-bound decode GEMM needs.
* **fold in registers** (larger M, prefill and the trainer's forward): one program per
  (128 weight rows, `PREFILL_TOKEN_TILE` tokens; two warpgroups of 64 rows) sums every chunk and
  folds as it goes; no workspace.

Every tile is computed swapped: each warpgroup's 64 weight rows are the MMA's M dimension
(Hopper's wgmma m64nXk32 at every batch size; no 64-row token tile for one token), and on the
tensor-core path both operands are FP8-typed, so cp.async lands them in the shared memory wgmma
reads (`tests/fp8/test_split_gemm.py` compiles every mode for sm_90 and checks it).
``split_linear(x, b)`` also quantizes the activation: at M <= `FUSE_MAX_M` inside the GEMM's
programs (the quantizer's own helpers, so the same codes and scales as `quantize_blockwise`; no
separate launch), else with the 1x128 Triton quantizer first.

Because the order is a function of K alone, a token's row is the same at M = 1 and among 8192
tokens, in both scale modes (no row padding as cuBLASLt's FP32-scale path needs); when the
rollout engine and the trainer both run this backend (``JETRL_FP8_GEMM_BACKEND=triton_splitk``),
the serving rows equal the trainer's forward. Under Triton's CPU interpreter the tile dot is
taken in float64 (exact), and the kernel gives `split_order.split_order_matmul`'s bits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from nemo_jetrl.fp8._deps import require
from nemo_jetrl.fp8.formats import get_format
from nemo_jetrl.fp8.quantize import INPUT_DTYPES, BlockQuantized
from nemo_jetrl.fp8.split_order import CHUNK_TILES, split_count
from nemo_jetrl.fp8.triton_gemm import native_dot, pipeline_stages, value_table
from nemo_jetrl.fp8.triton_launch import (
    NO_FTZ,
    _bits_if_bf16,
    _fp32,
    format_constants,
    frozen_meta,
    interpreting,
    launch,
)

SPLIT_MAX_M = 64
"""Token counts at or below which the split mode runs (speed only: both modes give one result)."""
FUSE_MAX_M = 16
"""Token counts at or below which `split_linear` quantizes inside the GEMM (speed only)."""
WEIGHT_ROWS = 64
"""Weight rows per warpgroup: the MMA's M dimension (Hopper's wgmma height) at every batch size.
A decode program has one warpgroup (4 warps); above `SPLIT_MAX_M` tokens a program has
`PREFILL_WARPGROUPS` of them, each running the same wgmma on its own 64 rows."""
PREFILL_WARPGROUPS = 2
"""Warpgroups per program above the decode sizes (128 weight rows: 8 warps)."""
DECODE_WARPGROUPS = 1
"""Warpgroups per program at the decode sizes (M <= `SPLIT_MAX_M`). 2 gives each program 128
weight rows, so each token chunk is read by half as many programs (a K step's token tile is
4 KB at M = 32 and 8 KB at 64, beside 8 KB of weight for 64 rows), over half as many programs:
speed only, `bench_serving_kernel.py --backends triton_splitk:a:a:3:wg2` times it on a GPU."""
PREFILL_TOKEN_TILE = 64
"""Tokens per program above `SPLIT_MAX_M`. The order keeps three fp32 tiles live (the tile dot,
the chunk's sum, the fold), all in registers at 128 x 64: ptxas for sm_90a gives 248 registers
(Triton 3.6's ptxas; 238 with 3.9's) and no spill; 128 tokens took 255 registers and spilled 1260 bytes a thread (the sm_90 census's
register check, scripts/sm90_census.py, 2026-11-29). Speed only: a row's bits do not depend on it."""
SPLIT_STAGES: int | None = None
"""Software-pipeline depth of the K loop on the FP8 dot (None: `triton_gemm.pipeline_stages`,
3; the value-table dot keeps its 1). A decode program runs 8 K tiles of 8 KB of weight (64 rows x 128) and at 3 stages holds
35 KB of shared memory and 74 registers a thread at M <= 16 (ptxas 3.6, sm_90a): speed only,
`bench_serving_kernel.py --backends triton_splitk:a:a:STAGES` times others on a GPU."""
SPLIT_TMA = False
"""Load the weight through a TMA descriptor (the TMA unit copies each [64 or 128, 128] block into
shared memory; fewer load instructions than cp.async's 16 bytes a lane) instead of pointer loads.
The same codes either way: speed only, `bench_serving_kernel.py --backends
triton_splitk:a:a:3:tma` times it on a GPU. A descriptor launches through Triton's own path."""
SPLIT_PREFETCH = False
"""In split mode, each program first asks L2 for its whole weight chunk (64 rows x 1 KB, one
``cp.async.bulk.prefetch.L2`` a row), so the chunk's bytes are requested from HBM at once rather
than a K-loop stage at a time; the loop then reads them from L2. A hint: the same codes and bits
(run 8 measured the split kernel at 1.80-1.86 TB/s at M <= 8 where BF16 streams 2.63-2.76).
Compiled programs only (not the interpreter, not with `SPLIT_TMA`): speed only,
`bench_serving_kernel.py --backends triton_splitk:a:a:3:pf` times it on a GPU."""
SPLIT_PDL = False
"""Launch the GEMM as a programmatic dependent launch (Hopper's PDL: ``launch_pdl``): its
programs may start while the kernel before it on the stream drains, doing nothing but the
weight prefetch (`SPLIT_PREFETCH`) until that kernel's writes are visible (``griddepcontrol.wait``,
before any activation load or store); each program lets the next PDL launch start once its sums
are done. The same bits. sm_90 and later, compiled programs only (not the interpreter): speed
only, `bench_serving_kernel.py --backends triton_splitk:a:a:3:pdl` (or ``pf+pdl``) times it."""
COUNTERS = 1 << 16
"""Split-mode tile counters per device (int32, `prepare`); a tile is ``ceil(N / 64)`` x token
tiles, and split mode has one token tile (M <= 64) unless forced."""


@functools.cache
def _kernel() -> ModuleType:
    require("triton", feature="the split-K FP8 GEMM")
    from nemo_jetrl.fp8 import _triton_split_jit

    return _triton_split_jit


@dataclass(frozen=True)
class SplitLaunch:
    """How one call is launched (chosen from M; the bits do not depend on it)."""

    split: bool
    """Split mode (a program per chunk, the last to finish folds) or the fold in registers."""
    token_tile: int
    """Tokens per program: the MMA's N dimension (16, 32 or 64)."""
    chunks: int
    """`split_order.split_count(K)`."""
    warpgroups: int = 1
    """Warpgroups per program, `WEIGHT_ROWS` weight rows each."""


def launch_for(m: int, k: int) -> SplitLaunch:
    """The launch mode and tile for ``m`` tokens and reduction length ``k``."""
    chunks = split_count(k)
    split = chunks > 1 and m <= SPLIT_MAX_M
    tile = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else PREFILL_TOKEN_TILE
    warpgroups = DECODE_WARPGROUPS if m <= SPLIT_MAX_M else PREFILL_WARPGROUPS
    return SplitLaunch(split, tile, chunks, warpgroups)


def _check(label: str, a_block, b: BlockQuantized, a_shape, out_dtype: torch.dtype) -> None:
    if a_block != (1, 128) or b.block not in ((1, 128), (128, 128)):
        raise ValueError(
            f"{label}: needs a 1x128 [M, K] and b 1x128 or 128x128 [N, K]; got a {a_block} "
            f"and b {b.block} (pass 128x1 operands as q.t())"
        )
    if len(a_shape) != 2 or b.data.dim() != 2 or a_shape[1] != b.data.shape[1]:
        raise ValueError(
            f"{label}: operands must be 2-D with the same K; got {tuple(a_shape)} and "
            f"{tuple(b.data.shape)}"
        )
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{label}: out_dtype {out_dtype} is not bf16/fp16/fp32")


@functools.cache
def _dot_mode(fmts: tuple[str, str], device: torch.device) -> int:
    """The tile dot for these formats on ``device`` (decided once per device and formats)."""
    jit = _kernel()
    if interpreting() or device.type != "cuda":
        return jit.DOT_EXACT.value
    if native_dot(fmts, torch.cuda.get_device_capability(device)):
        return jit.DOT_NATIVE.value
    return jit.DOT_TF32.value


_UNFUSED = (("IN_BF16", False), ("FMAX", 0.0), ("MAXV", 0.0), ("EPS", 0.0), ("POW2", False),
            ("MANT", 3), ("BIAS", 7), ("NATIVE_CAST", False))  # fmt: skip


@functools.cache
def _meta(
    b_rows: int, plan: SplitLaunch, quant: tuple, dot: int, fmts: tuple[str, str], stages: int,
    tma: bool, prefetch: bool = False, pdl: bool = False,
):  # fmt: skip
    """The kernel's constexprs and launch options for one configuration, built once."""
    jit = _kernel()
    fp8 = {"e4m3": jit.tl.float8e4nv, "e5m2": jit.tl.float8e5}
    return frozen_meta(
        CHUNK=CHUNK_TILES, B_ROWS=b_rows, BW=WEIGHT_ROWS * plan.warpgroups, BT=plan.token_tile,
        SPLIT=plan.split, FUSED=quant is not _UNFUSED, DOT=dot, FP8_A=fp8[fmts[0]],
        FP8_B=fp8[fmts[1]], **dict(quant), num_warps=4 * plan.warpgroups,
        num_stages=stages, TMA_W=tma, PREFETCH=prefetch, PDL=pdl,
        **({"launch_pdl": True} if pdl else {}), **NO_FTZ,
    )  # fmt: skip


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    """Whether ``device`` runs programmatic dependent launches (``griddepcontrol``: sm_90+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _pdl(device: torch.device) -> bool:
    """`SPLIT_PDL` for a launch on ``device``: off under the interpreter (no inline assembly;
    the bits do not depend on it), refused where it cannot run rather than timed as the default."""
    if not SPLIT_PDL or interpreting():
        return False
    if not _pdl_capable(device) or _kernel().gdc_wait is None:
        import triton

        raise RuntimeError(
            f"split_gemm: SPLIT_PDL needs a GPU of sm_90 or later and a Triton with "
            f"griddepcontrol (3.6 and 3.9 have it); got {device} and Triton {triton.__version__}: "
            f"set triton_split.SPLIT_PDL = False"
        )
    return True


_COUNTER_BUFFERS: dict[torch.device, torch.Tensor] = {}


def prepare(device: torch.device | str) -> torch.Tensor:
    """Make ``device``'s split-mode tile counters (zeros; each folding program sets its own back
    to zero, so they stay zero between calls). Made at the first call otherwise; a CUDA graph
    captured before any call would record them unzeroed, so they are made when the backend is
    planned (`gemm_backends.plan_gemm`: the vLLM layer plans at construction), as vLLM's Marlin
    kernels make their lock workspace at weight loading. One buffer
    per device, as Marlin's: split-mode calls on two streams at once would count each other's
    programs (vLLM's forward is one stream)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    buf = _COUNTER_BUFFERS.get(dev)
    if buf is None:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"split_gemm: the split-K tile counters of {dev} are made inside a CUDA graph "
                f"capture; call nemo_jetrl.fp8.triton_split.prepare({str(dev)!r}) (or run one "
                f"call) before capturing"
            )
        buf = _COUNTER_BUFFERS[dev] = torch.zeros(COUNTERS, dtype=torch.int32, device=dev)
    return buf


def _counters(dev: torch.device, tiles: int) -> torch.Tensor:
    if tiles > COUNTERS:
        raise ValueError(f"split_gemm: {tiles} tiles in split mode; at most COUNTERS = {COUNTERS}")
    return prepare(dev)


def _launch(x, qa, b: BlockQuantized, out_dtype, quant: tuple, a_fmt: str, plan: SplitLaunch):
    """One call of the kernel (and of the fold): ``x`` the unquantized input when ``quant``
    holds the quantizer's constants (`_fused_quant`), else ``qa`` the quantized one."""
    jit = _kernel()
    fused = quant is not _UNFUSED
    m, k = (x if fused else qa.data).shape
    n = b.data.shape[0]
    dev = b.data.device
    dot = _dot_mode((a_fmt, b.fmt), dev)
    # The interpreter's own fp32 -> bf16 conversion truncates: write fp32 there, round in torch.
    store_dtype = torch.float32 if interpreting() else out_dtype
    out = torch.empty(m, n, dtype=store_dtype, device=dev)
    if not (m and n):
        return out.to(out_dtype)
    native = dot == jit.DOT_NATIVE.value
    lut_a = b.scale_inv if native else value_table(a_fmt, dev)
    lut_b = b.scale_inv if native else value_table(b.fmt, dev)
    # FP8-typed operands on the tensor-core path: cp.async lands them where wgmma reads them
    # (uint8 would go shared -> registers -> bitcast); codes for the value tables elsewhere
    qb, sb = (b.data if native else b.data.view(torch.uint8)), b.scale_inv
    if fused:
        xa, qdat, sa = _bits_if_bf16(x), sb, sb  # any pointer stands in for the unused ones
        sx, sq, ss = (xa.stride(0), xa.stride(1)), (0, 0), (0, 0)
    else:
        xa, qdat, sa = sb, (qa.data if native else qa.data.view(torch.uint8)), qa.scale_inv
        sx, sq, ss = (0, 0), (qdat.stride(0), qdat.stride(1)), (sa.stride(0), sa.stride(1))
    kb, bt, s = -(-k // 128), plan.token_tile, plan.chunks
    ws = torch.empty(s if plan.split else 0, m, n, dtype=torch.float32, device=dev)
    grid = (-(-n // (WEIGHT_ROWS * plan.warpgroups)), -(-m // bt), s if plan.split else 1)
    cnt = _counters(dev, grid[0] * grid[1]) if plan.split else ws
    aligned = qb.is_contiguous() and qb.data_ptr() % 16 == 0 and k % 16 == 0
    tma = SPLIT_TMA and aligned
    # the prefetch's byte addresses need 1-byte codes (the FP8 dot's operands)
    prefetch = SPLIT_PREFETCH and plan.split and native and aligned and not (tma or interpreting())
    pdl = _pdl(dev)
    wb = _weight_descriptor(qb, WEIGHT_ROWS * plan.warpgroups) if tma else qb
    args = (
        xa, qdat, sa, wb, sb, lut_a, lut_b, ws, cnt, out, m, n, k, kb, s,
        *sx, *sq, *ss, qb.stride(0), qb.stride(1), sb.stride(0), sb.stride(1),
        m * n, n, out.stride(0), out.stride(1),
    )  # fmt: skip
    stages = (SPLIT_STAGES or pipeline_stages(True)) if native else pipeline_stages(False)
    meta = _meta(b.block[0], plan, quant, dot, (a_fmt, b.fmt), stages, tma, prefetch, pdl)
    if tma:  # descriptors: through Triton's own launch path
        jit.split_gemm_kernel[grid](*args, **meta)
    else:
        launch(jit.split_gemm_kernel, grid, args, meta)
    return out if store_dtype == out_dtype else out.to(out_dtype)


def _weight_descriptor(qb: torch.Tensor, rows: int):  # type: ignore[no-untyped-def]
    """A TMA descriptor over the contiguous ``[N, K]`` weight codes in ``[rows, 128]`` blocks
    (host metadata, no torch op; rows and columns past the end read as zeros)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(qb, list(qb.shape), [qb.shape[1], 1], [rows, 128])


@functools.cache
def _fused_quant(fmt: str, dtype: torch.dtype, native_cast: bool, eps: float, pow2: bool):
    """The quantizer's constants for the fused launch (`triton_kernels`' own), built once."""
    consts = format_constants(get_format(fmt), dtype, native_cast)
    return (
        ("IN_BF16", consts["IN_BF16"]), ("FMAX", consts["FMAX"]), ("MAXV", consts["MAXV"]),
        ("EPS", _fp32(eps) if eps > 0 else 0.0), ("POW2", bool(pow2)), ("MANT", consts["MANT"]),
        ("BIAS", consts["BIAS"]), ("NATIVE_CAST", consts["NATIVE"]),
    )  # fmt: skip


def split_gemm(
    a: BlockQuantized,
    b: BlockQuantized,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    split: bool | None = None,
) -> torch.Tensor:
    """``a @ b.T`` in the fixed split order (module docstring). ``split`` forces a mode
    (tests: both must give the same bits); None chooses from M (`launch_for`)."""
    _check("split_gemm", a.block, b, a.data.shape, out_dtype)
    plan = launch_for(a.data.shape[0], a.data.shape[1])
    if split is not None:
        plan = SplitLaunch(split and plan.chunks > 1, plan.token_tile, plan.chunks, plan.warpgroups)
    return _launch(None, a, b, out_dtype, _UNFUSED, a.fmt, plan)


def split_linear(
    x: torch.Tensor,
    b: BlockQuantized,
    *,
    pow2_scales: bool,
    eps: float = 0.0,
    fmt: str = "e4m3",
    out_dtype: torch.dtype = torch.bfloat16,
    fused: bool | None = None,
) -> torch.Tensor:
    """``quantize(x, 1x128) @ b.T`` with `quantize_blockwise`'s codes and scales, unchecked (a
    non-finite block gives its token a NaN row, as the serving quantizer does); ``fused``
    quantizes inside the GEMM (None: at M <= `FUSE_MAX_M`)."""
    from nemo_jetrl.fp8 import triton_kernels

    _check("split_linear", (1, 128), b, x.shape, out_dtype)
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"split_linear: x is {x.dtype}; use one of {INPUT_DTYPES}")
    m, k = x.shape
    fused = m <= FUSE_MAX_M if fused is None else fused
    if not fused:
        qa = triton_kernels.quantize_blockwise_triton(
            x, (1, 128), fmt=fmt, pow2_scales=pow2_scales, eps=eps, check_finite=False
        )
        return _launch(None, qa, b, out_dtype, _UNFUSED, fmt, launch_for(m, k))
    native_cast = triton_kernels.resolve_native_cast(x, None)
    quant = _fused_quant(fmt, x.dtype, native_cast, float(eps), bool(pow2_scales))
    return _launch(x, None, b, out_dtype, quant, fmt, launch_for(m, k))
