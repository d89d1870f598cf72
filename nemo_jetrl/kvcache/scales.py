"""`KVScales`: per-layer FP8 Q/K/V scales (dequantization multipliers), validated and frozen,
with their vLLM/NeMo-RL and Megatron names and a JSON form; `DEFAULT_SCALE` is what a reader
uses for a layer without one (vLLM's 1.0). `nemo_jetrl.kvcache.calibration` produces them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from nemo_jetrl.kvcache import names

DEFAULT_SCALE = 1.0  # what vLLM uses for a layer whose scale was never loaded


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
