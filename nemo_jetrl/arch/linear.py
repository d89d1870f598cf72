"""One linear layer of a model, the unit a recipe decides FP8 for, and the error of a bad model
description. Every family (dense, MoE, hybrid) lists its layers as `Linear`s.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from nemo_jetrl.fp8.spec import BLOCK

# Per-layer linears in execution order, with the HF module path under `model.layers.{i}.`.
ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
LAYER_GROUP = MappingProxyType(
    {**{n: "attn" for n in ATTN_LINEARS}, **{n: "mlp" for n in MLP_LINEARS}}
)


class ArchError(ValueError):
    """A model description that cannot be read; `key` names the config key to fix."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Linear:
    """One linear layer (torch layout: weight [out_features, in_features])."""

    name: str
    """Full HF parameter prefix, e.g. "model.layers.3.self_attn.q_proj"."""

    kind: str
    """Short name, e.g. "q_proj" or "lm_head"."""

    layer: int | None
    """Decoder layer index, or None for embeddings / lm_head."""

    in_features: int
    """GEMM reduction dim K (input features)."""

    out_features: int
    """GEMM output dim N (output features)."""

    bias: bool = False
    """The layer has a bias vector (Qwen2's q/k/v)."""

    @property
    def group(self) -> str:
        """ "attn", "mlp", or the kind itself for embed_tokens / lm_head."""
        return LAYER_GROUP.get(self.kind, self.kind)

    @property
    def aligned(self) -> bool:
        """Both dims are multiples of 128, so blockwise FP8 tiles the weight exactly."""
        return self.in_features % BLOCK == 0 and self.out_features % BLOCK == 0
