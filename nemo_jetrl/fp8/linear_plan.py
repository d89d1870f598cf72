"""What an `Fp8BlockLinear` runs, decided once per layer (not per call): `LinearPlan`.

A training step of one FP8 linear makes up to five quantizations and three GEMMs. Everything
that does not depend on the data is decided here, when the layer first sees an input of a given
device and dtypes: which quantizer runs (``JETRL_FP8_QUANT_BACKEND`` read now), which GEMM
backend each GEMM uses (``JETRL_FP8_GEMM_BACKEND`` read now, `gemm_backends.plan_gemm`), the
scale layout the quantizer writes for those GEMMs, whether non-finite input is checked at once
(CPU) or flagged on the device (CUDA), and whether the FP8 weight is cached across calls
(``JETRL_FP8_WEIGHT_CACHE=0`` turns the cache off). The per-call path then reads no
environment variable and makes no capability query; a changed environment variable reaches a
layer that already planned only through `Fp8BlockLinear.replan`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.gemm_backends import plan_gemm

ENV_WEIGHT_CACHE = "JETRL_FP8_WEIGHT_CACHE"
ENV_ROWCOL = "JETRL_FP8_ROWCOL"
ROWCOL_DEFAULT = "two_pass"
"""How x and dy get their 1x128 and transposed 128x1 codes when ``JETRL_FP8_ROWCOL`` is unset:
``two_pass`` (the 1x128 kernel, then the transposed 128x1 one) or ``fused`` (one kernel reading
each 128 x 128 tile once). Speed only: the same bits. Two passes were faster on every GPU
measurement: kernels alone at 8192 x 4096, 0.884 of the fused time on the H100 (h100_run6) and
0.75-0.78 on the H200 (run 7); run 8's sweep with both at their best tiles, 32.9 + 41.9 us
against 107.7 us (0.69); whole fwd+bwd steps in CUDA graphs, 0.910-0.985 on all 8 Llama/Qwen3
shapes (run 8, `bench_fp8_linear`'s ``graphed_two_pass/fused``)."""
# GEMM backends handed MN-major activation scales by the quantizer: cuBLASLt reads only that
# layout (`gemm_backends._scaled_mm` copies compact scales into it per call; at M % 4 == 0 the
# quantizer's padded layout is exactly that copy). DeepGEMM keeps the compact scales it was
# verified with on a GPU; the Triton GEMM and the reference read any strides.
MN_MAJOR_GEMMS = frozenset({"scaled_mm"})


@dataclass(frozen=True)
class LinearPlan:
    """One layer's decisions for inputs of one device and dtype (see the module docstring)."""

    key: tuple
    """(device, x dtype, weight dtype, bias dtype or None, config): what it was made for."""
    gpu: bool
    """The CUDA path: GEMMs through the planned backends, non-finite input flagged on the device
    (`finite_flags`) instead of a host check. False: the torch reference (CPU)."""
    quant: str | None
    """``backend=`` of the quantizer calls (None: the CPU reference, chosen by `dispatch`)."""
    fprop: str | None
    """GEMM backend of FProp (None: `gemm.blockwise_matmul` on the CPU path)."""
    dgrad: str | None
    """GEMM backend of DGrad."""
    wgrad: str | None
    """GEMM backend of WGrad."""
    x_layout: str
    """``scale_layout`` of x's 1x128 scales (``mn_major`` when FProp's GEMM reads it)."""
    dy_layout: str
    """``scale_layout`` of dy's 1x128 scales (``mn_major`` when DGrad's GEMM reads it)."""
    wgrad_layout: str
    """``scale_layout`` of the transposed 128x1 x/dy scales."""
    cache_weight: bool
    """Reuse the FP8 weight while the master weight is unchanged (`weight_cache`)."""
    fused_rowcol: bool
    """x and dy quantized 1x128 and 128x1 by the Triton quantizer (the CUDA path with it): from
    one read by the fused kernel, or in two passes when `two_pass_rowcol`; False: the torch
    quantizer twice."""
    fwd_kw: dict
    """Format, scale rule and eps of x and W (quantizer keywords, built once, never mutated)."""
    grad_kw: dict
    """The same for dy (the grad format: E5M2 under ``hybrid``)."""
    two_pass_rowcol: bool = False
    """With `fused_rowcol`: the 1x128 and the 128x1 (transposed) Triton kernels one after the
    other (`ROWCOL_DEFAULT`, ``JETRL_FP8_ROWCOL=two_pass``) instead of the fused one
    (``JETRL_FP8_ROWCOL=fused``): the same codes and scales, one more launch a tensor."""


def plan_key(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: Fp8LinearConfig
) -> tuple:
    """What a plan depends on: device, dtypes and the config object (a layer whose ``config`` is
    reassigned plans again; the same object compares by identity, no field compare per call)."""
    return (x.device, x.dtype, weight.dtype, None if bias is None else bias.dtype, config)


def rowcol_two_pass() -> bool:
    """``$JETRL_FP8_ROWCOL``: ``two_pass`` or ``fused`` (unset: `ROWCOL_DEFAULT`; read when a
    layer plans)."""
    value = os.environ.get(ENV_ROWCOL, ROWCOL_DEFAULT).strip().lower()
    if value not in ("fused", "two_pass"):
        raise ValueError(f"environment variable {ENV_ROWCOL} is {value!r}; use fused or two_pass")
    return value == "two_pass"


def weight_cache_enabled() -> bool:
    """``$JETRL_FP8_WEIGHT_CACHE`` (default on; 0/false/off turn the cache off)."""
    value = os.environ.get(ENV_WEIGHT_CACHE, "1").strip().lower()
    if value not in ("1", "true", "on", "0", "false", "off"):
        raise ValueError(f"environment variable {ENV_WEIGHT_CACHE} is {value!r}; use 1 or 0")
    return value in ("1", "true", "on")


def make_plan(
    key: tuple,
    config: Fp8LinearConfig,
    *,
    gpu: bool,
    quant: str | None,
    cache_weight: bool,
    fused_rowcol: bool | None = None,
) -> LinearPlan:
    """Plan the three GEMMs of a layer for inputs described by ``key`` (`plan_key`).
    ``gpu``/``quant``: the CUDA path and its quantizer, decided by the caller;
    ``fused_rowcol``: whether the fused Triton kernel runs (None: ``quant == "triton"``)."""
    device, x_dtype, w_dtype, b_dtype = key[:4]
    cache = cache_weight and weight_cache_enabled()
    scales = {"pow2_scales": config.pow2_scales, "eps": config.eps}
    kws = ({"fmt": config.forward_format, **scales}, {"fmt": config.grad_format, **scales})
    fused = gpu and (quant == "triton" if fused_rowcol is None else fused_rowcol)
    if not gpu:
        return LinearPlan(key, False, quant, None, None, None, *["compact"] * 3, cache, False, *kws)
    fwd, grad, pow2 = config.forward_format.name, config.grad_format.name, config.pow2_scales

    def backend(out_dtype: torch.dtype, kind: str, fmts: tuple[str, str]) -> str:
        return plan_gemm(
            device, out_dtype=out_dtype, pow2_scales=pow2, kind=kind, fmts=fmts
        ).backend

    fprop = backend(x_dtype if b_dtype is None else torch.float32, "fprop", (fwd, fwd))
    dgrad = backend(x_dtype, "fprop", (grad, fwd))
    wgrad = backend(w_dtype, "wgrad", (grad, fwd))
    layouts = [
        "mn_major" if quant == "triton" and gemm in MN_MAJOR_GEMMS else "compact"
        for gemm in (fprop, dgrad, wgrad)
    ]  # the torch quantizer writes compact scales only
    two_pass = fused and rowcol_two_pass()
    return LinearPlan(key, True, quant, fprop, dgrad, wgrad, *layouts, cache, fused, *kws, two_pass)
