"""The model description: every linear layer of a decoder-only transformer, with its shape.

A recipe decides FP8 per *linear layer*; whether a layer can be blockwise FP8 depends on its
shape (both GEMM dims must be multiples of 128 so that 1x128 activation groups and 128x128
weight blocks tile it exactly). This module turns a HuggingFace-style config (the keys of a
model's ``config.json``) into that list. Llama, Qwen2 and Qwen3 decoder layers have the same
seven linears:

    q_proj  [heads*head_dim, hidden]      k_proj, v_proj [kv_heads*head_dim, hidden]
    o_proj  [hidden, heads*head_dim]
    gate_proj, up_proj [intermediate, hidden]      down_proj [hidden, intermediate]

(weights stored [out_features, in_features] as in torch). Embeddings and ``lm_head`` are listed
too, but always stay BF16. Built-in descriptions carry the numbers of the public configs of
Llama-3.1-8B(-Instruct), Qwen2.5-7B and Qwen3-8B-Base; any other model is described by its
config.json.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_jetrl.arch.linear import ATTN_LINEARS, ArchError, Linear


@dataclass(frozen=True)
class ModelArch:
    """The shape of a decoder-only transformer (fields as in HF config.json)."""

    name: str
    """Display name (HF repo id for built-ins)."""

    model_type: str
    """HF `model_type`: "llama", "qwen2", "qwen3", ..."""

    hidden_size: int
    """Residual stream width (`hidden_size`)."""

    intermediate_size: int
    """MLP inner width (`intermediate_size`)."""

    num_layers: int
    """Decoder layers (`num_hidden_layers`)."""

    num_heads: int
    """Query heads (`num_attention_heads`)."""

    num_kv_heads: int
    """Key/value heads (`num_key_value_heads`; GQA when < num_heads)."""

    head_dim: int
    """Per-head dim (`head_dim`, default hidden_size / num_heads)."""

    vocab_size: int
    """Vocabulary size (`vocab_size`)."""

    tie_word_embeddings: bool = False
    """lm_head shares the embedding matrix (`tie_word_embeddings`)."""

    qkv_bias: bool = False
    """q/k/v projections have biases (Qwen2: true; `attention_bias` for Llama/Qwen3)."""

    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""

    def __post_init__(self) -> None:
        bad = [
            f"{k}={getattr(self, k)!r}"
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "vocab_size",
            )
            if not isinstance(getattr(self, k), int) or getattr(self, k) <= 0
        ]
        if bad:
            raise ArchError(f"model {self.name!r}: need positive integers, got {', '.join(bad)}")
        if self.head_dim % 2:
            raise ArchError(
                f"model {self.name!r}: head_dim {self.head_dim} is odd; rotary position "
                "embeddings rotate pairs of dims, so head_dim must be even (set head_dim, or "
                "hidden_size / num_attention_heads, to an even number)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ArchError(
                f"model {self.name!r}: num_attention_heads ({self.num_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_kv_heads})"
            )

    # -- construction --------------------------------------------------------------------------

    @staticmethod
    def from_hf_config(config: Mapping[str, Any], name: str | None = None) -> ModelArch:
        """From the keys of a HuggingFace config.json (Llama/Qwen2/Qwen3-style decoders)."""
        missing = [
            k
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "vocab_size",
            )
            if k not in config
        ]
        label = name or config.get("_name_or_path") or config.get("model_type", "model")
        if missing:
            raise ArchError(f"config of {label!r} lacks {', '.join(missing)}")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        model_type = str(config.get("model_type", "llama"))
        head_dim = config.get("head_dim")
        if not head_dim:
            if heads <= 0 or hidden % heads:
                raise ArchError(
                    f"config of {label!r}: hidden_size {hidden} is not divisible by "
                    f"num_attention_heads {heads} and head_dim is not set; set head_dim or make "
                    "hidden_size a multiple of num_attention_heads"
                )
            head_dim = hidden // heads
        qkv_bias = bool(config.get("attention_bias", model_type == "qwen2"))
        return ModelArch(
            name=str(label),
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=model_type == "qwen3",
        )

    @staticmethod
    def from_json(path: str | Path, key: str = "jetrl.model_config") -> ModelArch:
        """From a config.json file (or a directory holding one); errors name config ``key``."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            data = json.loads(p.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise ArchError(f"model config not found: {p}", key) from None
        except OSError as exc:
            raise ArchError(f"cannot read model config {p}: {exc.strerror}", key) from None
        except UnicodeDecodeError as exc:
            raise ArchError(
                f"model config {p} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                f"offset {exc.start})",
                key,
            ) from None
        except json.JSONDecodeError as exc:
            raise ArchError(f"model config {p} is not valid JSON: {exc}", key) from None
        if not isinstance(data, dict):
            raise ArchError(f"model config {p} must hold a JSON object", key)
        try:
            return ModelArch.from_hf_config(data, name=data.get("_name_or_path") or str(p))
        except (ArchError, TypeError, ValueError) as exc:
            raise ArchError(f"model config {p}: {exc}", key) from None

    def to_hf_config(self) -> dict[str, Any]:
        """The HF config keys (enough for transformers' Auto*.from_config with model_type)."""
        return {
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
        }

    # -- linears -------------------------------------------------------------------------------

    def layer_linears(self, layer: int) -> list[Linear]:
        """The seven linears of decoder layer `layer`, in execution order."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range for {self.name} ({self.num_layers})")
        h, q, kv, i = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        shapes = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        out = []
        for kind, (k_in, n_out) in shapes.items():
            module = "self_attn" if kind in ATTN_LINEARS else "mlp"
            out.append(
                Linear(
                    name=f"model.layers.{layer}.{module}.{kind}",
                    kind=kind,
                    layer=layer,
                    in_features=k_in,
                    out_features=n_out,
                    bias=self.qkv_bias and kind in ("q_proj", "k_proj", "v_proj"),
                )
            )
        return out

    def linears(self) -> list[Linear]:
        """Every decoder linear of every layer, then lm_head (always BF16)."""
        out = [lin for i in range(self.num_layers) for lin in self.layer_linears(i)]
        out.append(Linear("lm_head", "lm_head", None, self.hidden_size, self.vocab_size))
        return out

    def unaligned_linears(self) -> list[Linear]:
        """Decoder linears (one per kind; all layers share shapes) whose dims are not
        multiples of 128."""
        return [lin for lin in self.layer_linears(0) if not lin.aligned]

    def num_params(self) -> int:
        """Parameter count (embeddings, linears, norms), for sanity checks against model cards."""
        lin = sum(
            lin.in_features * lin.out_features + (lin.out_features if lin.bias else 0)
            for lin in self.layer_linears(0)
        )
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        emb = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else emb
        return self.num_layers * (lin + norms) + emb + head + self.hidden_size
