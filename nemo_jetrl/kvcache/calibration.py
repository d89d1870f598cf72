"""Trainer-side calibration of per-layer Q/K/V scales for an FP8 KV cache.

What is measured. For every attention layer, the largest magnitude (``amax``) of the query, key
and value tensors *as the attention kernel receives them*: after the q/k/v projections, any q/k
norm (Qwen3) and RoPE. That is exactly what a KV cache stores, so a scale derived from it puts
the cache's largest values near the top of the E4M3 range.

Which tokens count. A batch holds prompts, responses and padding. ``mask`` selects the tokens
whose Q/K/V enter the amax:

- ``"prompt_and_response"``: every real token (padding excluded),
- ``"response"``: generated tokens only (padding excluded),
- ``"none"``: everything, padding included. This is NeMo-RL's behaviour; padding positions run
  through the projections too and can carry large values that no cache ever stores.

How micro-batches are combined. Each forward pass over one micro-batch gives one amax sample per
layer and tensor. The samples are reduced by ``"max"`` or by a ``"percentile"`` (nearest rank on
the sorted samples: index ``round_half_even(p/100 * (n-1))``, the rule NeMo-RL uses, so with few
micro-batches the 99.9th percentile *is* the maximum). A percentile ignores a rare outlier
micro-batch; the margin then adds headroom.

The scale. ``scale = amax * margin / 448`` (E4M3), computed in float64 and rounded once to fp32,
the precision vLLM keeps. A result that is NaN, infinite, zero or negative (an all-masked layer,
a diverged forward, an underflow) is refused for that layer with a warning naming it, and the
layer keeps its previous scales; a layer with no previous scale is left out and readers fall
back to 1.0, vLLM's default.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_jetrl.fp8 import get_format
from nemo_jetrl.kvcache import names
from nemo_jetrl.kvcache.scales import DEFAULT_SCALE, KVScales
from nemo_jetrl.kvcache.settings import (
    MASK_MODES,
    REDUCTIONS,
    CalibrationSettings,
    Layout,
    MaskMode,
    Reduction,
)
from nemo_jetrl.recipe_parts import KV_PERCENTILE

# The values live in `nemo_jetrl.kvcache.settings` and `.scales`; importing them from here
# keeps working.
__all__ = [
    "DEFAULT_SCALE",
    "MASK_MODES",
    "REDUCTIONS",
    "AmaxObserver",
    "CalibrationResult",
    "CalibrationSettings",
    "KVScaleRefusedWarning",
    "KVScales",
    "Layout",
    "MaskMode",
    "Reduction",
    "masked_amax",
    "reduce_samples",
    "scale_from_amax",
    "scales_from_amax",
    "select_sequences",
    "token_mask",
]


class KVScaleRefusedWarning(UserWarning):
    """A calibrated KV scale was invalid; the layer keeps its previous scales."""


# -- masks -----------------------------------------------------------------------------------


def token_mask(
    attention_mask: torch.Tensor | None,
    response_mask: torch.Tensor | None,
    mode: MaskMode,
) -> torch.Tensor | None:
    """``[batch, tokens]`` bool mask of the tokens the observers count, or None for all tokens.

    ``attention_mask`` marks real tokens (1) versus padding (0); ``response_mask`` marks generated
    tokens. ``"none"`` counts everything, padding included.
    """
    if mode not in MASK_MODES:
        raise ValueError(f"mask={mode!r}: use one of {MASK_MODES}")
    if mode == "none":
        return None
    real = None if attention_mask is None else attention_mask.bool()
    if mode == "prompt_and_response":
        return real
    if response_mask is None:
        raise ValueError("mask='response' needs a response_mask marking the generated tokens")
    resp = response_mask.bool()
    return resp if real is None else resp & real


def select_sequences(batch_size: int, fraction: float) -> torch.Tensor:
    """Indices of ``ceil(fraction * batch_size)`` (at least 1) evenly spaced sequences."""
    if batch_size < 1:
        raise ValueError("calibration needs at least one sequence")
    n = max(1, min(batch_size, math.ceil(fraction * batch_size - 1e-9)))
    return torch.div(torch.arange(n) * batch_size, n, rounding_mode="floor")


# -- observer --------------------------------------------------------------------------------


def masked_amax(
    x: torch.Tensor, mask: torch.Tensor | None, layout: Layout = "bhtd"
) -> torch.Tensor:
    """``max |x|`` over the tokens selected by ``mask`` ([batch, tokens]) as a 0-d fp32 tensor.

    ``layout`` names x's dims: "bhtd" (HF attention functions), "bthd", or "sbhd" (Megatron).
    Masked-out positions are excluded even when they hold NaN or Inf.
    """
    a = x.detach().abs().float()
    if mask is None:
        return a.amax()
    m = mask.to(device=a.device, dtype=torch.bool)
    if layout == "bhtd":
        mb = m[:, None, :, None]
    elif layout == "bthd":
        mb = m[:, :, None, None]
    elif layout == "sbhd":
        mb = m.t()[:, :, None, None]
    else:
        raise ValueError(f"layout={layout!r}: use 'bhtd', 'bthd' or 'sbhd'")
    return torch.where(mb, a, torch.zeros((), dtype=a.dtype, device=a.device)).amax()


class AmaxObserver:
    """Collects one amax sample per attention layer, tensor and micro-batch.

    Call `set_mask` before each micro-batch forward (None counts every token), then the
    attention hook calls `observe` once per layer. Samples stay on device as 0-d tensors and are
    synchronised once, in `amax`.
    """

    def __init__(self, include_q: bool = True) -> None:
        self.include_q = include_q
        self._mask: torch.Tensor | None = None
        self._samples: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.micro_batches = 0

    def set_mask(self, mask: torch.Tensor | None) -> None:
        """The ``[batch, tokens]`` token mask for the next forward (None: all tokens)."""
        self._mask = mask
        self.micro_batches += 1

    def observe(
        self,
        layer: int,
        q: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layout: Layout = "bhtd",
    ) -> None:
        """Record the masked amax of this layer's q (optional), k and v for this micro-batch."""
        mask = self._mask
        if mask is not None:
            tokens = {"bhtd": k.shape[2], "bthd": k.shape[1], "sbhd": k.shape[0]}[layout]
            if mask.shape[-1] != tokens:
                raise ValueError(
                    f"KV observer, layer {layer}: token mask covers {mask.shape[-1]} tokens but "
                    f"keys have {tokens} (calibrate on a full forward, not with a KV cache)"
                )
        per = self._samples.setdefault(layer, {"q": [], "k": [], "v": []})
        if self.include_q and q is not None:
            per["q"].append(masked_amax(q, mask, layout))
        per["k"].append(masked_amax(k, mask, layout))
        per["v"].append(masked_amax(v, mask, layout))

    def samples(self) -> dict[int, dict[str, list[float]]]:
        """``{layer: {"q"|"k"|"v": [amax per micro-batch]}}`` as Python floats."""
        flat = [(i, t, s) for i, per in self._samples.items() for t, ss in per.items() for s in ss]
        if not flat:
            return {}
        values = torch.stack([s.to("cpu") for _, _, s in flat]).tolist()
        out: dict[int, dict[str, list[float]]] = {}
        for (i, t, _), val in zip(flat, values, strict=True):
            out.setdefault(i, {}).setdefault(t, []).append(val)
        return out

    def amax(
        self, reduction: Reduction, percentile: float = KV_PERCENTILE
    ) -> dict[int, dict[str, float]]:
        """The reduced amax per layer and tensor."""
        return {
            i: {t: reduce_samples(s, reduction, percentile) for t, s in per.items() if s}
            for i, per in sorted(self.samples().items())
        }


def reduce_samples(
    samples: Iterable[float], reduction: Reduction, percentile: float = KV_PERCENTILE
) -> float:
    """Max, or nearest-rank percentile (index ``round_half_even(p/100*(n-1))``), of the samples.

    NaN samples make the result NaN (a NaN must be refused, never hidden by the reduction).
    """
    vals = list(samples)
    if not vals:
        raise ValueError("no amax samples to reduce")
    if any(math.isnan(v) for v in vals):
        return math.nan
    if reduction == "max":
        return max(vals)
    if reduction != "percentile":
        raise ValueError(f"reduction={reduction!r}: use one of {REDUCTIONS}")
    vals.sort()
    rank = round(percentile / 100.0 * (len(vals) - 1))
    return vals[max(0, min(len(vals) - 1, rank))]


def scale_from_amax(amax: float, margin: float, fmax: float = 448.0) -> float:
    """``fp32(amax * margin / fmax)`` (the product and quotient in float64, one rounding)."""
    exact = amax * margin / fmax
    if math.isnan(exact) or math.isinf(exact):
        return exact
    return float(torch.tensor(exact, dtype=torch.float64).to(torch.float32))


@dataclass(frozen=True)
class CalibrationResult:
    """What one calibration produced."""

    scales: KVScales
    """Scales to use from now on: new ones where valid, previous ones where refused."""

    amax: Mapping[int, Mapping[str, float]]
    """Reduced amax per layer and tensor (before margin), as measured."""

    refused: Mapping[int, str] = field(default_factory=dict)
    """Refused layers: {layer: message} (each also emitted as a KVScaleRefusedWarning)."""

    micro_batches: int = 0
    """Forward passes (micro-batches) run."""

    sequences: int = 0
    """Sequences observed."""

    seconds: float = 0.0
    """Wall-clock seconds spent (forward passes and reduction)."""

    def to_nemo_rl(self, settings: CalibrationSettings) -> dict[str, Any]:
        """NeMo-RL's result shape: ``{"format", "percentile", "margin", "layers": {vllm name: s}}``."""
        return {
            "format": "fp8",
            "percentile": settings.percentile if settings.reduction == "percentile" else 100.0,
            "margin": settings.margin,
            "layers": self.scales.to_vllm(include_q=settings.include_q),
        }

    def report(self) -> dict[str, Any]:
        """What our policy workers add to NeMo-RL's result under ``"jetrl"``."""
        return {
            "refused": dict(self.refused),
            "seconds": self.seconds,
            "micro_batches": self.micro_batches,
        }


def scales_from_amax(
    amax: Mapping[int, Mapping[str, float]],
    settings: CalibrationSettings,
    previous: KVScales | None = None,
) -> tuple[KVScales, dict[int, str]]:
    """Scales from reduced amax; invalid layers refused (warning) and their previous scales kept.

    Layers in ``previous`` that were not observed at all keep their scales too.
    """
    fmax = get_format(settings.fmt).fmax
    out: dict[int, dict[str, float]] = {
        i: dict(p) for i, p in (previous.layers if previous else {}).items()
    }
    refused: dict[int, str] = {}
    for i, per in sorted(amax.items()):
        new = {t: scale_from_amax(a, settings.margin, fmax) for t, a in per.items()}
        bad = {t: s for t, s in new.items() if not (0.0 < s < math.inf)}
        if not bad:
            out[i] = new
            continue
        prev = out.get(i)
        kept = (
            "keeping previous scales " + ", ".join(f"{t}={s:.6g}" for t, s in sorted(prev.items()))
            if prev
            else f"no previous scale, so readers use the default {DEFAULT_SCALE}"
        )
        detail = ", ".join(f"{t} amax={per[t]!r} -> scale {s!r}" for t, s in sorted(bad.items()))
        msg = (
            f"KV scale calibration layer {i}: refused ({names.vllm_scale_name(i, 'k').rsplit('.', 1)[0]}): "
            f"{detail} is not a finite positive number; {kept}. Check the layer's activations "
            "(all tokens masked out? NaN/Inf in the forward?)"
        )
        refused[i] = msg
        warnings.warn(msg, KVScaleRefusedWarning, stacklevel=3)
    return KVScales(out, settings.fmt), refused
