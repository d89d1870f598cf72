"""Settings of the trainer-side FP8 KV scale calibration: `CalibrationSettings` (config:
``jetrl.kv_calibration``; which tokens count, how micro-batch amax samples are reduced, the
margin) and the allowed values of its fields (`MASK_MODES`, `REDUCTIONS`, the observers' tensor
`Layout`). `nemo_jetrl.kvcache.calibration` turns these settings into scales.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from nemo_jetrl.fp8 import get_format

MaskMode = Literal["response", "prompt_and_response", "none"]
Reduction = Literal["max", "percentile"]
Layout = Literal["bhtd", "sbhd", "bthd"]
MASK_MODES: tuple[str, ...] = ("response", "prompt_and_response", "none")
REDUCTIONS: tuple[str, ...] = ("max", "percentile")


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
        """From `nemo_jetrl.recipe_parts.KvCalibration` (or anything with the same attributes).

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
