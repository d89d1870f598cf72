"""Emulation of vLLM 0.32's own (unpatched) FP8 quantizers, in plain torch.

Why this exists: an unpatched vLLM rollout quantizes with its *own* formulas, which differ from
the trainer's (`nemo_jetrl.fp8.quantize`). The local backend uses this module to emulate such a
rollout (the off-policy "BF16-train + FP8-rollout" recipes), and the tests use it to measure the
differences DESIGN.md reports. Written from reading vLLM 0.32's source; bit-exact to every
``vllm.*`` entry of the golden vectors.

The two vLLM paths (E4M3 only; fmax = 448):

* Activations, ``QuantFP8._quantize_group_native`` (per token, groups of 128 along the last dim,
  the last group zero-padded)::

      amax  = max |x| over the group (fp32)
      s     = amax / 448                         # fp32 division: the *dequantization* scale
      if ue8m0: s = 2 ** ceil(log2(s))           # round the scale UP to a power of two
      s     = max(s, 1 / (448 * 512))            # floor: groups with amax < 1/512 lose precision
      q     = fp8(clamp(x / s, -448, 448))       # divide by the scale (TE multiplies by 448/amax)

  The floor also applies to all-zero groups, whose stored scale is 1/(448*512) (TE stores 1.0).

* Weights, ``vllm.utils.deep_gemm.per_block_cast_to_fp8`` (128x128 blocks, zero-padded)::

      amax  = max(max |x| over the block, 1e-4)  # amax floor instead of a scale floor
      s     = amax / 448
      if ue8m0: s = 2 ** ceil(log2(s))
      q     = fp8(x * (1 / s))                   # multiply by the fp32 reciprocal; no clamp

Why FP32 scales disagree with TE: TE rounds ``448/amax`` once and multiplies; vLLM rounds
``amax/448`` and then divides by it (or multiplies by its rounded reciprocal), so ``x * scale``
and ``x / s`` can land on different sides of an FP8 rounding boundary. With power-of-two scales
every step is exact and both agree (2**ceil(log2(amax/448))) == 1 / 2**floor(log2(448/amax))
whenever neither side hits a floor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_jetrl.fp8.formats import E4M3
from nemo_jetrl.fp8.quantize import BlockQuantized

VLLM_VERSION = "0.32.0"  # the source these formulas were read from
GROUP_SIZE = 128
SCALE_FLOOR = 1.0 / (E4M3.fmax * 512.0)  # QuantFP8's minimum scaling factor
WEIGHT_AMAX_FLOOR = 1e-4  # per_block_cast_to_fp8's amax clamp


def _check(x: torch.Tensor, name: str | None, what: str) -> str:
    label = f"{what}(tensor {name!r})" if name else what
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{label}: dtype {x.dtype} cannot be quantized; use bf16/fp16/fp32")
    return label


def _ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(s)) computed with torch's fp32 log2/ceil/exp2, as vLLM does."""
    return torch.exp2(torch.ceil(torch.log2(s)))


def quantize_group_native(
    x: torch.Tensor, *, ue8m0: bool, group_size: int = GROUP_SIZE, name: str | None = None
) -> BlockQuantized:
    """vLLM's native per-token-group quantizer (activations, 1x128), see the module docstring.

    ``x`` may be N-D; groups run along the last dim. Returns a ``BlockQuantized`` with block
    ``(1, group_size)`` whose ``scale_inv`` is vLLM's scale (a dequantization multiplier, shape
    ``[*x.shape[:-1], ceil(K/group_size)]``); ``pow2_scales`` records ``ue8m0`` (floored scales of
    tiny groups are not powers of two).
    """
    _check(x, name, "quantize_group_native")
    if x.dim() == 0:
        raise ValueError("quantize_group_native needs at least 1-D input")
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    groups = -(-k // group_size)
    xp = F.pad(x, (0, groups * group_size - k)) if groups * group_size != k else x
    xg = xp.reshape(-1, groups, group_size)
    amax = xg.abs().amax(dim=-1, keepdim=True).float()
    s = amax / E4M3.fmax
    if ue8m0:
        s = _ceil_pow2(s)
    s = torch.clamp_min(s, SCALE_FLOOR)
    q = torch.clamp(xg.float() / s, -E4M3.fmax, E4M3.fmax).to(E4M3.dtype)
    q = q.reshape(-1, groups * group_size)[:, :k].reshape(x.shape)
    return BlockQuantized(
        q.contiguous(), s.reshape(*lead, groups), (1, group_size), E4M3.name, ue8m0
    )


def per_block_cast_native(
    x: torch.Tensor, *, ue8m0: bool, block: int = 128, name: str | None = None
) -> BlockQuantized:
    """vLLM's ``per_block_cast_to_fp8`` (weights, 128x128), see the module docstring.

    Returns a ``BlockQuantized`` with block ``(block, block)``; ``scale_inv`` is vLLM's scale
    ``[ceil(N/128), ceil(K/128)]``.
    """
    label = _check(x, name, "per_block_cast_native")
    if x.dim() != 2:
        raise ValueError(f"{label}: needs 2-D input, got shape {tuple(x.shape)}")
    m, n = x.shape
    mb, nb = -(-m // block), -(-n // block)
    xp = F.pad(x, (0, nb * block - n, 0, mb * block - m))
    xv = xp.reshape(mb, block, nb, block)
    amax = torch.clamp_min(xv.abs().float().amax(dim=(1, 3), keepdim=True), WEIGHT_AMAX_FLOOR)
    s = amax / E4M3.fmax
    if ue8m0:
        s = _ceil_pow2(s)
    # No clamp before the cast (vLLM has none): x * (1/s) never exceeds 448 by more than
    # an fp32 ulp, which the saturating RNE cast maps back to 448.
    q = (xv.float() * torch.reciprocal(s)).to(E4M3.dtype)
    q = q.reshape(mb * block, nb * block)[:m, :n]
    return BlockQuantized(q.contiguous(), s.reshape(mb, nb), (block, block), E4M3.name, ue8m0)
