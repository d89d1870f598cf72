"""Checks a quantized weight passes before a rollout layer stores it (all-or-nothing refits).

A refit stages every tensor first and commits only when all passed (`Fp8InferenceLinear.
stage_quantized` / `commit`, the local and vLLM refits). What can be wrong with a 128x128-block
FP8 weight even though its bytes and scales have the right shapes: FP8 bytes that encode NaN
(E4M3FN 0x7f/0xff; E5M2 also inf), scales that are not finite and > 0, and blocks whose
dequantized values overflow fp32 (a BF16/FP16-max weight with power-of-two scales rounds its
scale up past what 448 x scale can hold).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nemo_jetrl.fp8.spec import BLOCK


class StagedWeight(NamedTuple):
    """A quantized weight (and bias) `Fp8InferenceLinear.stage_quantized` accepted."""

    data: torch.Tensor
    """FP8 weight bytes ``[N, K]`` in the layer's FP8 dtype."""
    scale_inv: torch.Tensor
    """fp32 dequantization scales ``[ceil(N/128), ceil(K/128)]``."""
    bias: torch.Tensor | None
    """The bias in the layer's bias dtype, or None to keep the current one."""


def quantized_weight_problem(
    data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> str | None:
    """Why a 128x128-block FP8 weight cannot be used, or None: FP8 bytes that encode NaN/inf,
    scales that are not finite and > 0, or blocks whose dequantized values overflow ``dtype``
    (the dtype the layer computes in; fp32 at most, the GEMM accumulator's)."""
    s = scale_inv.float()
    bad_s = ~(torch.isfinite(s) & (s > 0))
    if bool(bad_s.any()):
        idx = [int(i) for i in bad_s.nonzero()[0]]
        n = int(bad_s.sum())
        return f"scale_inv has {n} non-finite or non-positive entries (first at block {idx})"
    a = data.float().abs()
    bad = ~torch.isfinite(a)
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0]]
        byte = int(data[tuple(idx)].view(torch.uint8))
        return f"{int(bad.sum())} FP8 byte(s) encode NaN/inf (first {byte:#04x} at {idx})"
    nb, kb = s.shape
    a = torch.nn.functional.pad(a, (0, kb * BLOCK - a.shape[1], 0, nb * BLOCK - a.shape[0]))
    top = (a.reshape(nb, BLOCK, kb, BLOCK).amax(dim=(1, 3)) * s).to(dtype)
    over = ~torch.isfinite(top)
    if bool(over.any()):
        idx = [int(i) for i in over.nonzero()[0]]
        return (
            f"{int(over.sum())} block(s) dequantize past the {dtype} range (first block {idx}: "
            f"max |fp8| x scale = inf); the weight is too large for this scale mode"
        )
    return None
