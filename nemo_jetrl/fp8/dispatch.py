"""Which implementation runs: Triton kernels on CUDA, the torch reference elsewhere.

Quantization. `quantize_blockwise(..., backend=None)` (exported as
`nemo_jetrl.fp8.quantize_blockwise`) is the entry point: CPU tensors without ``backend`` go
straight to the reference; CUDA tensors, or an explicit ``backend``, pick:

* ``"triton"`` - `triton_kernels.quantize_blockwise_triton`: one memory pass, same bits.
* ``"torch"`` - `quantize.quantize_reference` (always available, any device).
* ``"auto"`` (default) - Triton for CUDA tensors when triton imports, else torch.

The environment variable ``JETRL_FP8_QUANT_BACKEND`` (``auto``/``triton``/``torch``) overrides
the default for CUDA tensors; an explicit ``backend=`` argument overrides both. Backends are
bit-identical by construction and by test, so the choice changes speed only.

GEMM. `fp8_gemm(a, b)` computes ``a @ b.T`` for ``a`` 1x128-blocked ``[M, K]`` and ``b``
128x128-blocked ``[N, K]`` (FProp and DGrad of an FP8 linear) or 1x128-blocked (WGrad, both
operands blocked along tokens), choosing:

1. ``"deep_gemm"`` - DeepGEMM's ``fp8_gemm_nt`` (FProp/DGrad pair) when ``deep_gemm`` imports,
   both operands are E4M3 on CUDA, and the GPU is SM90, or SM100 with power-of-two scales
   (SM100 DeepGEMM stores scales as UE8M0, exact only for powers of two).
2. ``"scaled_mm"`` - ``torch.nn.functional.scaled_mm`` with DeepSeek-style blockwise scaling
   (cuBLASLt; SM90 only, CUDA >= 12.9, E4M3; also the WGrad 1x128 x 1x128 pair).
3. ``"reference"`` - `gemm.blockwise_matmul` (dequantize + fp32 matmul; any device).

``JETRL_FP8_GEMM_BACKEND`` or ``backend=`` forces one (an unrunnable choice fails loudly).

GEMM output bits differ between kernels (accumulation order, Hopper's reduced-precision FP8
tensor-core accumulator); only the quantized inputs are part of the on-policy promise. The `gpu`
tests bound each fast path against float64 as stated in `GEMM_TOLERANCE`.
"""

from __future__ import annotations

import os

import torch

from nemo_jetrl.fp8._deps import available, require
from nemo_jetrl.fp8.formats import Fp8Format, get_format
from nemo_jetrl.fp8.gemm import blockwise_matmul
from nemo_jetrl.fp8.quantize import Block, BlockQuantized, check_block, quantize_reference

QUANT_BACKENDS = ("auto", "triton", "torch")
GEMM_BACKENDS = ("auto", "deep_gemm", "scaled_mm", "reference")
ENV_QUANT_BACKEND = "JETRL_FP8_QUANT_BACKEND"
ENV_GEMM_BACKEND = "JETRL_FP8_GEMM_BACKEND"

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
) -> BlockQuantized:
    """Quantize ``x`` with one scale per ``block``: `quantize.quantize_reference`'s bits.

    CUDA tensors go to the bit-identical Triton kernel when triton is installed;
    ``backend="torch"`` (or ``JETRL_FP8_QUANT_BACKEND=torch``) forces the reference. CPU calls
    without ``backend`` run the reference directly.
    """
    block = check_block(block)
    f = get_format(fmt)
    fast = backend != "torch" and (x.is_cuda or backend is not None)
    if fast and quant_backend(x, backend) == "triton":
        from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

        return quantize_blockwise_triton(
            x, block, fmt=f, pow2_scales=pow2_scales, eps=eps, name=name
        )
    return quantize_reference(x, block, fmt=f, pow2_scales=pow2_scales, eps=eps, name=name)


# ----------------------------------------------------------------------------------------- GEMM


def _pair_kind(a: BlockQuantized, b: BlockQuantized) -> str | None:
    """``"fprop"`` (1x128 x 128x128: FProp, DGrad), ``"wgrad"`` (1x128 x 1x128), or None."""
    if a.data.dim() != 2 or b.data.dim() != 2 or a.fmt != "e4m3" or b.fmt != "e4m3":
        return None
    if a.block == (1, 128) and b.block == (128, 128):
        return "fprop"
    if a.block == (1, 128) and b.block == (1, 128):
        return "wgrad"
    return None


def gemm_backend(a: BlockQuantized, b: BlockQuantized, backend: str | None = None) -> str:
    """The GEMM backend `fp8_gemm` would use for ``a @ b.T`` (see the module docstring)."""
    choice = _choice(backend, ENV_GEMM_BACKEND, GEMM_BACKENDS)
    if choice != "auto":
        return choice
    kind = _pair_kind(a, b)
    if not (a.data.is_cuda and b.data.is_cuda and kind):
        return "reference"
    major, _ = torch.cuda.get_device_capability(a.data.device)
    pow2 = a.pow2_scales and b.pow2_scales
    if kind == "fprop" and available("deep_gemm") and (major == 9 or (major == 10 and pow2)):
        return "deep_gemm"
    if major == 9 and _cuda_at_least(12, 9) and hasattr(torch.nn.functional, "scaled_mm"):
        return "scaled_mm"
    return "reference"


def _cuda_at_least(major: int, minor: int) -> bool:
    version = torch.version.cuda
    if not version:
        return False
    parts = tuple(int(p) for p in version.split(".")[:2])
    return parts >= (major, minor)


def fp8_gemm(
    a: BlockQuantized,
    b: BlockQuantized,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
    exact: bool = False,
) -> torch.Tensor:
    """``a @ b.T`` for ``a`` ``[M, K]`` and ``b`` ``[N, K]`` blocked along K, on the chosen backend.

    Fast backends take E4M3 ``a`` 1x128 with ``b`` 128x128 (FProp, DGrad) or 1x128 (WGrad, as
    ``qdy_colwise.t()`` and ``qx_colwise.t()``; scaled_mm only); anything else runs the reference.
    ``exact`` is the reference's flag (per-tile fp32 accumulation, `gemm.blockwise_matmul`); the
    fast kernels always accumulate per K tile.
    """
    chosen = gemm_backend(a, b, backend)
    if chosen == "reference":
        return blockwise_matmul(a, b, out_dtype=out_dtype, exact=exact)
    kind = _pair_kind(a, b)
    if kind is None or (chosen == "deep_gemm" and kind != "fprop"):
        raise ValueError(
            f"fp8_gemm backend {chosen!r} needs E4M3 operands a: 1x128 [M, K] and b: 128x128 "
            f"[N, K]{' or 1x128 [N, K]' if chosen == 'scaled_mm' else ''}; got a {a.fmt} "
            f"{a.block} {tuple(a.data.shape)}, b {b.fmt} {b.block} {tuple(b.data.shape)}; "
            "use backend='reference'"
        )
    if chosen == "deep_gemm":
        return _deep_gemm(a, b, out_dtype)
    return _scaled_mm(a, b, kind, out_dtype)


def _deep_gemm(a: BlockQuantized, b: BlockQuantized, out_dtype: torch.dtype) -> torch.Tensor:
    deep_gemm = require("deep_gemm", feature="the DeepGEMM FP8 GEMM backend")
    m, n = a.data.shape[0], b.data.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.data.device)
    # fp8_gemm_nt takes (data, fp32 scale) pairs in the compact layout and transforms the
    # scales into its TMA-aligned (and on SM100, UE8M0) layout itself.
    deep_gemm.fp8_gemm_nt(
        (a.data.contiguous(), a.scale_inv.float()),
        (b.data.contiguous(), b.scale_inv.float().contiguous()),
        out,
    )
    return out


def _mn_major(s: torch.Tensor) -> torch.Tensor:
    """``[R, kb]`` scales with strides ``(1, R)`` (cuBLASLt's 1x128 scale layout)."""
    s = s.float()
    return s if s.stride() == (1, s.shape[0]) else s.t().contiguous().t()


def _scaled_mm(
    a: BlockQuantized, b: BlockQuantized, kind: str, out_dtype: torch.dtype
) -> torch.Tensor:
    import torch.nn.functional as F

    k = a.data.shape[1]
    kb = -(-k // 128)
    if kind == "fprop":
        # scale_b: [round_up(kb, 4), N/128] with strides (1, round_up(kb, 4)).
        kb4 = -(-kb // 4) * 4
        sb = torch.zeros(b.scale_inv.shape[0], kb4, dtype=torch.float32, device=b.data.device)
        sb[:, :kb] = b.scale_inv
        scale_b, recipe_b = sb.t(), F.ScalingType.BlockWise128x128
    else:
        scale_b, recipe_b = _mn_major(b.scale_inv), F.ScalingType.BlockWise1x128
    # b is passed as [K, N] column-major (= b.data.t()), scale_a as [M, kb] strides (1, M).
    return F.scaled_mm(
        a.data.contiguous(),
        b.data.contiguous().t(),
        _mn_major(a.scale_inv),
        F.ScalingType.BlockWise1x128,
        scale_b,
        recipe_b,
        output_dtype=out_dtype,
    )
