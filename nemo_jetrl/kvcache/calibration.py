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
from types import MappingProxyType
from typing import Any, Literal

import torch

from nemo_jetrl.fp8 import get_format
from nemo_jetrl.kvcache import names

MaskMode = Literal["response", "prompt_and_response", "none"]
Reduction = Literal["max", "percentile"]
Layout = Literal["bhtd", "sbhd", "bthd"]
MASK_MODES: tuple[str, ...] = ("response", "prompt_and_response", "none")
REDUCTIONS: tuple[str, ...] = ("max", "percentile")
DEFAULT_SCALE = 1.0  # what vLLM uses for a layer whose scale was never loaded


class KVScaleRefusedWarning(UserWarning):
    """A calibrated KV scale was invalid; the layer keeps its previous scales."""


@dataclass(frozen=True)
class CalibrationSettings:
    """How Q/K/V amax become FP8 KV scales (config: ``jetrl.kv_calibration``)."""

    # Fraction (0 < f <= 1) of the step's sequences fed to the observers; sequences are taken at
    # evenly spaced indices (deterministic, consumes no RNG state).
    data_fraction: float = 1.0
    # "max" of the per-micro-batch amax samples, or their "percentile".
    reduction: Reduction = "percentile"
    # Percentile (0 < p <= 100) used when reduction is "percentile" (NeMo-RL: 99.9).
    percentile: float = 99.9
    # Headroom multiplied into the amax (>= 1; NeMo-RL: 1.05).
    margin: float = 1.05
    # Tokens the observers see: "response", "prompt_and_response" or "none" (padding included).
    mask: MaskMode = "prompt_and_response"
    # Also calibrate the query scale (needed when the attention kernel takes FP8 queries).
    include_q: bool = True
    # Sequences per forward pass during calibration (one amax sample per layer per pass).
    # Fewer, larger passes are cheaper (measured on CPU: 8 passes of 4 cost 2x one pass of 32);
    # a percentile differs from the max only with hundreds of passes.
    micro_batch_size: int = 32
    # FP8 format of the cache ("e4m3"; "e5m2" exists in vLLM but needs no calibration usually).
    fmt: str = "e4m3"

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid KV calibration settings: " + "; ".join(problems))

    def problems(self, prefix: str = "") -> list[str]:
        """Every invalid field as ``key=value (what is allowed)``."""
        out = []
        p = prefix
        if not _is_number(self.data_fraction) or not 0.0 < self.data_fraction <= 1.0:
            out.append(f"{p}data_fraction={self.data_fraction!r} (must be in (0, 1])")
        if self.reduction not in REDUCTIONS:
            out.append(f"{p}reduction={self.reduction!r} (allowed: {', '.join(REDUCTIONS)})")
        if not _is_number(self.percentile) or not 0.0 < self.percentile <= 100.0:
            out.append(f"{p}percentile={self.percentile!r} (must be in (0, 100])")
        if not _is_number(self.margin) or not (1.0 <= self.margin < math.inf):
            out.append(f"{p}margin={self.margin!r} (must be a finite number >= 1)")
        if self.mask not in MASK_MODES:
            out.append(f"{p}mask={self.mask!r} (allowed: {', '.join(MASK_MODES)})")
        if (
            not isinstance(self.micro_batch_size, int)
            or isinstance(self.micro_batch_size, bool)
            or self.micro_batch_size < 1
        ):
            out.append(f"{p}micro_batch_size={self.micro_batch_size!r} (must be an integer >= 1)")
        try:
            get_format(self.fmt)
        except ValueError:
            out.append(f"{p}fmt={self.fmt!r} (allowed: e4m3, e5m2)")
        return out

    @staticmethod
    def from_cfg(
        cfg: Mapping[str, Any] | None, prefix: str = "jetrl.kv_calibration"
    ) -> CalibrationSettings | list[str]:
        """Settings from a YAML mapping, or the list of every problem with its full key path.

        Accepts the recipe keys (``enabled`` is the caller's business and ignored here) plus
        ``reduction``, ``include_q``, ``micro_batch_size`` and ``fmt``. ``reduction`` defaults
        to "max" when ``percentile`` is 100, else "percentile".
        """
        cfg = dict(cfg or {})
        fields = {f for f in CalibrationSettings.__dataclass_fields__}
        problems = [
            f"{prefix}.{k}: unknown key (allowed: {', '.join(sorted(fields | {'enabled'}))})"
            for k in cfg
            if k not in fields and k != "enabled"
        ]
        kw = {k: v for k, v in cfg.items() if k in fields}
        if "reduction" not in kw and _is_number(kw.get("percentile", 99.9)):
            kw["reduction"] = "max" if float(kw.get("percentile", 99.9)) >= 100.0 else "percentile"
        if "include_q" in kw and not isinstance(kw["include_q"], bool):
            problems.append(f"{prefix}.include_q={kw['include_q']!r} (must be true or false)")
        probe = object.__new__(CalibrationSettings)
        for name, f in CalibrationSettings.__dataclass_fields__.items():
            object.__setattr__(probe, name, kw.get(name, f.default))
        problems += [f"{prefix}.{p}" for p in probe.problems()]
        if problems:
            return problems
        return CalibrationSettings(**kw)

    @staticmethod
    def from_recipe(kv_calibration: Any, **overrides: Any) -> CalibrationSettings:
        """From `nemo_jetrl.recipe.KvCalibration` (or anything with the same attributes).

        A missing or None ``reduction`` means "max" when percentile is 100, else "percentile";
        a missing or None ``include_q``, ``micro_batch_size`` or ``fmt`` keeps this class's
        default. ``overrides`` win over both.
        """
        pct = float(getattr(kv_calibration, "percentile", 99.9))
        reduction = getattr(kv_calibration, "reduction", None)
        kw: dict[str, Any] = {
            "data_fraction": float(getattr(kv_calibration, "data_fraction", 1.0)),
            "percentile": pct,
            "reduction": reduction or ("max" if pct >= 100.0 else "percentile"),
            "margin": float(getattr(kv_calibration, "margin", 1.05)),
            "mask": getattr(kv_calibration, "mask", "prompt_and_response"),
        }
        for key in ("include_q", "micro_batch_size", "fmt"):
            if getattr(kv_calibration, key, None) is not None:
                kw[key] = getattr(kv_calibration, key)
        kw.update(overrides)
        return CalibrationSettings(**kw)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


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

    def amax(self, reduction: Reduction, percentile: float = 99.9) -> dict[int, dict[str, float]]:
        """The reduced amax per layer and tensor."""
        return {
            i: {t: reduce_samples(s, reduction, percentile) for t, s in per.items() if s}
            for i, per in sorted(self.samples().items())
        }


def reduce_samples(
    samples: Iterable[float], reduction: Reduction, percentile: float = 99.9
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


# -- scales ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVScales:
    """Per-layer FP8 scales (dequantization multipliers), keyed by decoder layer index.

    ``layers[i]`` maps "k", "v" and optionally "q" to a positive finite fp32-representable float.
    """

    layers: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    fmt: str = "e4m3"

    def __post_init__(self) -> None:
        frozen = {}
        for i, per in self.layers.items():
            if not isinstance(i, int) or i < 0:
                raise ValueError(f"KV scales: layer key {i!r} must be a decoder index >= 0")
            entry = {}
            for t, s in per.items():
                if t not in names.TENSORS:
                    raise ValueError(f"KV scales, layer {i}: unknown tensor {t!r} (use q, k, v)")
                s = float(s)
                if not (0.0 < s < math.inf):
                    raise ValueError(
                        f"KV scales, layer {i}: {t}_scale={s!r} must be finite and > 0"
                    )
                entry[t] = s
            frozen[i] = MappingProxyType(entry)
        object.__setattr__(self, "layers", MappingProxyType(dict(sorted(frozen.items()))))

    def get(self, layer: int, tensor: str, default: float | None = DEFAULT_SCALE) -> float | None:
        """The scale of ``tensor`` in ``layer``, or ``default`` (vLLM's 1.0) when absent."""
        per = self.layers.get(layer)
        if per is None or tensor not in per:
            return default
        return per[tensor]

    def to_vllm(self, include_q: bool = True) -> dict[str, float]:
        """Flat ``{vLLM/NeMo-RL refit name: scale}`` (``model.layers.{i}.self_attn.k_scale``...)."""
        return {
            names.vllm_scale_name(i, t): s
            for i, per in self.layers.items()
            for t, s in per.items()
            if include_q or t != "q"
        }

    def to_megatron(self, *, layer_offset: int = 0) -> dict[str, float]:
        """Flat ``{decoder.layers.{i}.self_attention.core_attention.{t}_scale: scale}``."""
        return {
            names.megatron_scale_name(i, t, layer_offset=layer_offset): s
            for i, per in self.layers.items()
            for t, s in per.items()
            if i >= layer_offset
        }

    @staticmethod
    def from_vllm(flat: Mapping[str, float], fmt: str = "e4m3") -> KVScales:
        """Inverse of `to_vllm` (accepts names with or without the ``.attn`` hop)."""
        layers: dict[int, dict[str, float]] = {}
        for name, s in flat.items():
            i = names.layer_index_from_hf(name)
            tensor = name.rsplit(".", 1)[-1].removesuffix("_scale")
            if i is None or tensor not in names.TENSORS or not name.endswith("_scale"):
                raise ValueError(f"{name!r} is not a vLLM q/k/v scale name")
            layers.setdefault(i, {})[tensor] = float(s)
        return KVScales(layers, fmt)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly ``{"fmt":..., "layers": {"0": {"k":..., "v":...}}}``."""
        return {"fmt": self.fmt, "layers": {str(i): dict(p) for i, p in self.layers.items()}}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> KVScales:
        """Inverse of `to_dict`."""
        return KVScales(
            {int(i): dict(p) for i, p in d.get("layers", {}).items()}, d.get("fmt", "e4m3")
        )


def scale_from_amax(amax: float, margin: float, fmax: float = 448.0) -> float:
    """``fp32(amax * margin / fmax)`` (the product and quotient in float64, one rounding)."""
    exact = amax * margin / fmax
    if math.isnan(exact) or math.isinf(exact):
        return exact
    return float(torch.tensor(exact, dtype=torch.float64).to(torch.float32))


@dataclass(frozen=True)
class CalibrationResult:
    """What one calibration produced."""

    # Scales to use from now on: new ones where valid, previous ones where refused.
    scales: KVScales
    # Reduced amax per layer and tensor (before margin), as measured.
    amax: Mapping[int, Mapping[str, float]]
    # Refused layers: {layer: message} (each also emitted as a KVScaleRefusedWarning).
    refused: Mapping[int, str] = field(default_factory=dict)
    # Forward passes (micro-batches) and sequences observed.
    micro_batches: int = 0
    sequences: int = 0
    # Wall-clock seconds spent (forward passes and reduction).
    seconds: float = 0.0

    def to_nemo_rl(self, settings: CalibrationSettings) -> dict[str, Any]:
        """NeMo-RL's result shape: ``{"format", "percentile", "margin", "layers": {vllm name: s}}``."""
        return {
            "format": "fp8",
            "percentile": settings.percentile if settings.reduction == "percentile" else 100.0,
            "margin": settings.margin,
            "layers": self.scales.to_vllm(include_q=settings.include_q),
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
