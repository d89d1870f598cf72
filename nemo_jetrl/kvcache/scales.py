"""`KVScales`: per-layer FP8 Q/K/V scales (dequantization multipliers), validated and frozen,
with their vLLM/NeMo-RL and Megatron names and a JSON form; `DEFAULT_SCALE` is what a reader
uses for a layer without one (vLLM's 1.0). `nemo_jetrl.kvcache.calibration` produces them.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from nemo_jetrl.kvcache import names

DEFAULT_SCALE = 1.0  # what vLLM uses for a layer whose scale was never loaded


def scale_problem(value: Any) -> str | None:
    """Why ``value`` is not a usable KV scale, or None. The rule every KV-scale path applies:
    a real number (not bool, not a string), finite and > 0 *as the fp32 the engine stores*
    (1e-46 is 0 in fp32 and 1e39 is inf)."""
    if hasattr(value, "numel") and value.numel() == 1:  # a one-element tensor
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number, got {type(value).__name__} {value!r}"
    v = float(value)
    try:
        as_fp32 = struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:  # rounds past fp32's largest finite value
        as_fp32 = math.copysign(math.inf, v)
    if not math.isfinite(as_fp32) or as_fp32 <= 0:
        return f"{value!r} must be finite and > 0 in fp32 (it is {as_fp32!r} there)"
    return None


def layer_problem(layer: Any, num_layers: int | None = None) -> str | None:
    """Why ``layer`` is not a decoder index (of a ``num_layers``-layer model), or None."""
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        return f"layer key {layer!r} must be a decoder index >= 0"
    if num_layers is not None and layer >= num_layers:
        return f"layer {layer} does not exist (the model has {num_layers} decoder layers)"
    return None


@dataclass(frozen=True)
class KVScales:
    """Per-layer FP8 scales (dequantization multipliers), keyed by decoder layer index.

    ``layers[i]`` maps "k", "v" and optionally "q" to a positive finite fp32-representable float.
    """

    layers: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    """Decoder layer index -> {"q"/"k"/"v": scale}."""
    fmt: str = "e4m3"
    """FP8 format of the cache the scales are for."""
    calibrated_for: int | None = None
    """The weights version (refit / trainer step) these scales were calibrated on; a refit
    that sends other weights refuses them as stale. None: unknown (not checked)."""

    def __post_init__(self) -> None:
        frozen = {}
        problems = []
        for i, per in self.layers.items():
            if (why := layer_problem(i)) is not None:
                problems.append(why)
                continue
            entry = {}
            for t, s in per.items():
                if t not in names.TENSORS:
                    problems.append(f"layer {i}: unknown tensor {t!r} (use q, k, v)")
                elif (why := scale_problem(s)) is not None:
                    problems.append(f"layer {i}: {t}_scale {why}")
                else:
                    entry[t] = float(s)
            frozen[i] = MappingProxyType(entry)
        if problems:
            raise ValueError("KV scales refused: " + "; ".join(problems))
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
        out: dict[str, Any] = {"fmt": self.fmt}
        out["layers"] = {str(i): dict(p) for i, p in self.layers.items()}
        if self.calibrated_for is not None:
            out["calibrated_for"] = self.calibrated_for
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> KVScales:
        """Inverse of `to_dict`."""
        return KVScales(
            {int(i): dict(p) for i, p in d.get("layers", {}).items()},
            d.get("fmt", "e4m3"),
            d.get("calibrated_for"),
        )
