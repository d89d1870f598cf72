"""Which implementation runs: Triton kernels on CUDA, the torch reference elsewhere.

Quantization. `quantize_blockwise(..., backend=None)` (exported as
`nemo_jetrl.fp8.quantize_blockwise`) is the entry point: CPU tensors without ``backend`` go
straight to the reference; CUDA tensors, or an explicit ``backend``, pick:

* ``"triton"`` - `triton_kernels.quantize_blockwise_triton`: one memory pass, same bits.
* ``"torch"`` - `quantize.quantize_reference` (always available, any device).
* ``"auto"`` (default) - Triton for CUDA tensors when triton imports, else torch.

The environment variable ``JETRL_FP8_QUANT_BACKEND`` (``auto``/``triton``/``torch``) overrides
the default for CUDA tensors; an explicit ``backend=`` argument overrides both. These functions
read it per call when no ``backend`` is given; `Fp8BlockLinear` reads it (and
``JETRL_FP8_GEMM_BACKEND``) once per layer plan and passes ``backend=`` (`linear_plan`). Backends are
bit-identical by construction and by test, so the choice changes speed only.

GEMM. `fp8_gemm(a, b)` computes ``a @ b.T`` for ``a`` 1x128-blocked ``[M, K]`` and ``b``
128x128-blocked ``[N, K]`` (FProp and DGrad of an FP8 linear) or 1x128-blocked (WGrad, both
operands blocked along tokens) on the backend `gemm_backends.plan_gemm` chose for that GEMM
signature (decided once per process and signature, not per call): DeepGEMM, cuBLASLt
``scaled_mm`` or our Triton block GEMM on CUDA, the reference `gemm.blockwise_matmul` on CPU.
``JETRL_FP8_GEMM_BACKEND`` or ``backend=`` forces one (an unrunnable choice fails loudly).

GEMM output bits differ between kernels (accumulation order, Hopper's reduced-precision FP8
tensor-core accumulator); only the quantized inputs are part of the on-policy promise. The `gpu`
tests bound each fast path against float64 as stated in `GEMM_TOLERANCE`.
"""

from __future__ import annotations

import os

import torch

from nemo_jetrl.fp8 import finite_flags
from nemo_jetrl.fp8.formats import Fp8Format, get_format
from nemo_jetrl.fp8.gemm import blockwise_matmul
from nemo_jetrl.fp8.gemm_backends import ENV_GEMM_BACKEND as ENV_GEMM_BACKEND
from nemo_jetrl.fp8.gemm_backends import GEMM_BACKENDS as GEMM_BACKENDS
from nemo_jetrl.fp8.gemm_backends import (
    GemmBackendError,
    GemmPlan,
    forced_backend,
    pair_kind,
    plan_gemm,
    run_gemm,
)
from nemo_jetrl.fp8.quantize import Block, BlockQuantized, check_block, quantize_reference

QUANT_BACKENDS = ("auto", "triton", "torch")
ENV_QUANT_BACKEND = "JETRL_FP8_QUANT_BACKEND"

# |out - ref64| <= REL * (|A| @ |B|.T) + OUT * |ref64| for the fast GEMMs (A, B dequantized):
# Hopper accumulates FP8 products in ~14-bit precision inside each 128-wide K tile before
# DeepGEMM/cuBLAS promote to fp32 (DeepSeek-V3 report, section 3.3.2): 128 * 2**-14 = 2**-7
# worst case per tile; OUT covers the final bf16 rounding.
GEMM_TOLERANCE = {"REL": 2.0**-7, "OUT": 2.0**-8}


def _choice(arg: str | None, env: str, allowed: tuple[str, ...]) -> str:
    value = arg if arg is not None else os.environ.get(env, "auto")
    value = value.strip().lower()
    if value not in allowed:
        source = "backend argument" if arg is not None else f"environment variable {env}"
        raise ValueError(f"{source} is {value!r}; use one of {list(allowed)}")
    return value


def quant_backend(x: torch.Tensor, backend: str | None = None) -> str:
    """The quantization backend that would run for ``x`` ("triton" or "torch")."""
    from nemo_jetrl.fp8 import triton_kernels

    choice = _choice(backend, ENV_QUANT_BACKEND, QUANT_BACKENDS)
    if choice == "torch":
        return "torch"
    runnable = triton_kernels.can_run(x)
    if choice == "triton":
        if not runnable:
            raise RuntimeError(
                "Triton FP8 quantization was requested but cannot run here: it needs triton "
                "installed and a CUDA tensor (or TRITON_INTERPRET=1 for CPU tensors); unset "
                f"{ENV_QUANT_BACKEND} or pass backend='torch'"
            )
        return "triton"
    return "triton" if runnable and x.is_cuda else "torch"


def quantize_blockwise(
    x: torch.Tensor,
    block: Block,
    *,
    fmt: str | Fp8Format = "e4m3",
    pow2_scales: bool = True,
    eps: float = 0.0,
    name: str | None = None,
    backend: str | None = None,
    check_finite: bool = True,
    transpose: bool = False,
    scale_layout: str = "compact",
    nonfinite_flag: torch.Tensor | None = None,
) -> BlockQuantized:
    """Quantize ``x`` with one scale per ``block``: `quantize.quantize_reference`'s bits.

    CUDA tensors go to the bit-identical Triton kernel when triton is installed;
    ``backend="torch"`` (or ``JETRL_FP8_QUANT_BACKEND=torch``) forces the reference. CPU calls
    without ``backend`` run the reference directly. ``check_finite=False`` is the serving path:
    no host sync on any backend (CUDA-graph safe); blocks with a non-finite value get a NaN
    ``scale_inv`` instead of an error. ``transpose`` (128x1 only) returns the result's ``.t()``
    (block 1x128, data ``[K, M]``: WGrad's operand); Triton writes it directly, the torch path
    transposes (a contiguous copy on CUDA, a view on CPU). ``scale_layout="mn_major"`` asks the
    Triton kernel for GEMM-ready MN-major scales (`triton_kernels`); the torch path always
    returns compact scales (same values; every GEMM backend takes either). ``nonfinite_flag``
    (`finite_flags.flag`): set on the device where a block is non-finite, by the Triton kernel
    itself (no extra launch), by `finite_flags.note` on the torch path.
    """
    block = check_block(block)
    f = get_format(fmt)
    kw = {"fmt": f, "pow2_scales": pow2_scales, "eps": eps, "name": name}
    if transpose and block != (128, 1):
        raise ValueError(
            f"quantize_blockwise: transpose=True is only for block (128, 1), got {block}"
        )
    if _fast(x, backend):
        from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

        return quantize_blockwise_triton(
            x,
            block,
            check_finite=check_finite,
            transpose=transpose,
            scale_layout=scale_layout,
            nonfinite_flag=nonfinite_flag,
            **kw,
        )
    q = quantize_reference(x, block, check_finite=check_finite, **kw)
    if nonfinite_flag is not None:
        finite_flags.note(nonfinite_flag, q.scale_inv)
    return _transposed(q) if transpose else q


def quantize_with_transpose(
    x: torch.Tensor,
    block: Block,
    *,
    fmt: str | Fp8Format = "e4m3",
    pow2_scales: bool = True,
    eps: float = 0.0,
    name: str | None = None,
    backend: str | None = None,
    check_finite: bool = True,
    nonfinite_flag: torch.Tensor | None = None,
) -> tuple[BlockQuantized, BlockQuantized]:
    """``(q, q.t())`` of 2-D ``x`` (the FP8 weight for FProp and DGrad): one Triton pass writes
    both data layouts contiguous; the torch path transposes (a copy on CUDA, a view on CPU).
    ``nonfinite_flag`` as in `quantize_blockwise`."""
    kw = {"fmt": get_format(fmt), "pow2_scales": pow2_scales, "eps": eps, "name": name}
    if _fast(x, backend):
        from nemo_jetrl.fp8.triton_kernels import quantize_with_transpose_triton

        return quantize_with_transpose_triton(
            x, check_block(block), check_finite=check_finite, nonfinite_flag=nonfinite_flag, **kw
        )
    q = quantize_reference(x, check_block(block), check_finite=check_finite, **kw)
    if nonfinite_flag is not None:
        finite_flags.note(nonfinite_flag, q.scale_inv)
    return q, _transposed(q)


def _fast(x: torch.Tensor, backend: str | None) -> bool:
    """Whether the Triton quantizer runs (CPU tensors without ``backend`` take the reference)."""
    fast = backend != "torch" and (x.is_cuda or backend is not None)
    return fast and quant_backend(x, backend) == "triton"


def _transposed(q: BlockQuantized) -> BlockQuantized:
    t = q.t()
    if not t.data.is_cuda:
        return t
    # GEMM kernels want the reduction dim contiguous; copy once here rather than per GEMM.
    return BlockQuantized(t.data.contiguous(), t.scale_inv, t.block, t.fmt, t.pow2_scales)


# ----------------------------------------------------------------------------------------- GEMM


def _plan(a: BlockQuantized, b: BlockQuantized, out_dtype: torch.dtype, backend: str | None):
    kind = pair_kind(a, b)
    forced = forced_backend(backend)
    if kind is None:
        if forced not in ("auto", "reference"):
            raise GemmBackendError(
                f"fp8_gemm backend {forced!r} needs a: 1x128 [M, K] and b: 1x128 or 128x128 "
                f"[N, K]; got a {a.block} {tuple(a.data.shape)}, b {b.block} "
                f"{tuple(b.data.shape)}; use backend='reference'"
            )
        if a.data.is_cuda:
            raise GemmBackendError(
                f"fp8_gemm: no GPU kernel for a {a.block} x b {b.block} pair (a must be 1x128); "
                "pass backend='reference' to dequantize explicitly"
            )
        return GemmPlan("reference", "operand pair only the reference handles")
    return plan_gemm(
        a.data.device,
        out_dtype=out_dtype,
        pow2_scales=a.pow2_scales and b.pow2_scales,
        kind=kind,
        fmts=(a.fmt, b.fmt),
        backend=backend,
    )


def gemm_backend(
    a: BlockQuantized,
    b: BlockQuantized,
    backend: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> str:
    """The GEMM backend `fp8_gemm` uses for ``a @ b.T`` (see `gemm_backends`)."""
    return _plan(a, b, out_dtype, backend).backend


def fp8_gemm(
    a: BlockQuantized,
    b: BlockQuantized,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
    exact: bool = False,
    planned: bool = False,
) -> torch.Tensor:
    """``a @ b.T`` for ``a`` ``[M, K]`` and ``b`` ``[N, K]`` blocked along K, on the planned backend.

    ``exact`` is the reference's flag (TE's per-tile order, `gemm.blockwise_matmul`); the GPU
    kernels always accumulate per K tile. ``planned=True``: ``backend`` is what `plan_gemm`
    already chose for this GEMM (`linear_plan`): run it with no re-planning (no environment
    read, no cache lookup per call).
    """
    chosen = backend if planned and backend else _plan(a, b, out_dtype, backend).backend
    if chosen == "reference":
        return blockwise_matmul(a, b, out_dtype=out_dtype, exact=exact)
    return run_gemm(chosen, a, b, out_dtype)
