"""Settings of the trainer-side FP8 KV scale calibration: `CalibrationSettings` (config:
``jetrl.kv_calibration``; which tokens count, how micro-batch amax samples are reduced, the
margin) and the allowed values of its fields (`MASK_MODES`, `REDUCTIONS`, the observers' tensor
`Layout`). `nemo_jetrl.kvcache.calibration` turns these settings into scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from nemo_jetrl.fp8 import get_format
from nemo_jetrl.recipe_parts import (
    KV_CALIBRATION_RULES,
    KV_DATA_FRACTION,
    KV_MARGIN,
    KV_MASK,
    KV_MASKS,
    KV_PERCENTILE,
    KV_REDUCTIONS,
    kv_calibration_problems,
)

MaskMode = Literal["response", "prompt_and_response", "none"]
Reduction = Literal["max", "percentile"]
Layout = Literal["bhtd", "sbhd", "bthd"]
MASK_MODES: tuple[str, ...] = KV_MASKS
REDUCTIONS: tuple[str, ...] = KV_REDUCTIONS


@dataclass(frozen=True)
class CalibrationSettings:
    """How Q/K/V amax become FP8 KV scales (config: ``jetrl.kv_calibration``)."""

    data_fraction: float = KV_DATA_FRACTION
    """Fraction (0 < f <= 1) of the step's sequences fed to the observers; sequences are taken at
    evenly spaced indices (deterministic, consumes no RNG state)."""

    reduction: Reduction = "percentile"
    """How the per-micro-batch amax samples reduce: "max", or their "percentile"."""

    percentile: float = KV_PERCENTILE
    """Percentile (0 < p <= 100) used when reduction is "percentile" (NeMo-RL's default)."""

    margin: float = KV_MARGIN
    """Headroom multiplied into the amax (>= 1; NeMo-RL's default)."""

    mask: MaskMode = KV_MASK
    """Tokens the observers see: "response", "prompt_and_response" or "none" (padding included)."""

    include_q: bool = True
    """Also calibrate the query scale (needed when the attention kernel takes FP8 queries)."""

    micro_batch_size: int = 32
    """Sequences per forward pass during calibration (one amax sample per layer per pass). Fewer,
    larger passes are cheaper (measured on CPU: 8 passes of 4 cost 2x one pass of 32); a
    percentile differs from the max only with hundreds of passes."""

    fmt: str = "e4m3"
    """FP8 format of the cache ("e4m3"; "e5m2" exists in vLLM but needs no calibration usually)."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid KV calibration settings: " + "; ".join(problems))

    def problems(self, prefix: str = "") -> list[str]:
        """Every invalid field as ``key=value (must be ...)``: the rules of
        `nemo_jetrl.recipe_parts.KV_CALIBRATION_RULES`, where ``reduction``, ``include_q`` and
        ``micro_batch_size`` are resolved (null is not allowed here), and the cache format."""
        values = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "fmt"}
        bad = kv_calibration_problems(values)
        for key in ("reduction", "include_q", "micro_batch_size"):
            if values[key] is None:
                bad[key] = KV_CALIBRATION_RULES[key][1].removesuffix(" (or null)")
        out = [f"{prefix}{k}={values[k]!r} (must be {what})" for k, what in bad.items()]
        try:
            get_format(self.fmt)
        except ValueError:
            out.append(f"{prefix}fmt={self.fmt!r} (allowed: e4m3, e5m2)")
        return out

    @staticmethod
    def from_recipe(kv_calibration: Any, **overrides: Any) -> CalibrationSettings:
        """From `nemo_jetrl.recipe_parts.KvCalibration` (or anything with the same attributes).

        A missing or None ``reduction`` means "max" when percentile is 100, else "percentile";
        a missing or None ``include_q``, ``micro_batch_size`` or ``fmt`` keeps this class's
        default. ``overrides`` win over both.
        """
        pct = float(getattr(kv_calibration, "percentile", KV_PERCENTILE))
        reduction = getattr(kv_calibration, "reduction", None)
        kw: dict[str, Any] = {
            "data_fraction": float(getattr(kv_calibration, "data_fraction", KV_DATA_FRACTION)),
            "percentile": pct,
            "reduction": reduction or default_reduction(pct),
            "margin": float(getattr(kv_calibration, "margin", KV_MARGIN)),
            "mask": getattr(kv_calibration, "mask", KV_MASK),
        }
        for key in ("include_q", "micro_batch_size", "fmt"):
            if getattr(kv_calibration, key, None) is not None:
                kw[key] = getattr(kv_calibration, key)
        kw.update(overrides)
        return CalibrationSettings(**kw)


def default_reduction(percentile: float) -> Reduction:
    """The reduction a calibration without one uses: "max" at the 100th percentile."""
    return "max" if percentile >= 100.0 else "percentile"
