"""`ModelArch`: a model's description, every linear layer with its shape and group.

A recipe decides FP8 per *linear layer*; whether a layer can be blockwise FP8 depends on its
shape (both GEMM dims must be multiples of 128 so that 1x128 activation groups and 128x128
weight blocks tile it exactly). `ModelArch.from_hf_config` turns the keys of a model's
``config.json`` into that list, composing the families per decoder layer:

- token mixer: full attention (`dense.attention_linears`; DeepSeek's latent attention,
  `mla`), or gated linear attention on the hybrid family's linear layers (`hybrid`);
  Nemotron-H has one mixer per layer instead, Mamba-2, attention, MLP or experts (`mamba`);
- MLP: dense (`dense.mlp_linears`) or, on an MoE model's MoE layers, router + experts +
  shared experts (`moe`);
- outside the decoder: embeddings, ``lm_head`` (always BF16) and a vision tower (`hybrid`,
  BF16 in training; in the rollout when its per-name list names "visual").

Weights are [out_features, in_features] as in torch; names are transformers 5's parameter
names (`model.layers.{i}....`; Qwen3.5's multimodal checkpoints: `model.language_model.layers`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_jetrl.arch.dense import attention_linears, mlp_linears
from nemo_jetrl.arch.hybrid import HybridSpec, VisionSpec, read_hybrid, read_vision
from nemo_jetrl.arch.keys import Keys
from nemo_jetrl.arch.linear import VISION_WORD, ArchError, Linear
from nemo_jetrl.arch.mamba import ATTENTION, MambaSpec, is_nemotron_h, nemotron_h_fields
from nemo_jetrl.arch.mla import MlaSpec, read_mla
from nemo_jetrl.arch.moe import MoeSpec, read_moe
from nemo_jetrl.arch.state_space import refuse_state_space
from nemo_jetrl.errors import cwd_hint

# model_type families (transformers' names; "_text" variants are Qwen3.5's decoder configs).
_QK_NORM = (
    "qwen3",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
)
_OUTPUT_GATE = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_MLA = ("deepseek_v2", "deepseek_v3", "kimi_k2")
_QWEN2_BIAS = ("qwen2", "qwen2_moe")  # q/k/v biased by default, o_proj never
# The model types whose transformers model `from_hf_config` reproduces weight for weight
# (tests/arch/test_arch_compared_types.py builds each one and compares every parameter). Any
# other type is read as a Llama-style decoder, which may not be its layout: with transformers
# 5.24, phi3 fuses qkv_proj and gate_up_proj, starcoder2's MLP is c_fc/c_proj, arcee's and
# apertus' MLP is up/down only.
COMPARED_TYPES = frozenset(
    {
        *("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2"),
        *("granite", "qwen2_moe", "qwen3_moe", "mixtral", "minimax_m2", "deepseek_v2"),
        *("deepseek_v3", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "nemotron_h"),
    }
)


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

    o_bias: bool = False
    """o_proj has a bias (`attention_bias` of Llama/Qwen3/Qwen3.5; never Qwen2)."""

    output_gate: bool = False
    """q_proj also yields a per-head output gate, so it is twice as wide (Qwen3-Next/3.5)."""

    moe: MoeSpec | None = None
    """Mixture-of-experts layers (`moe`), or None for a dense MLP everywhere."""

    mla: MlaSpec | None = None
    """Latent attention (`mla`, DeepSeek) instead of q/k/v/o, or None."""

    hybrid: HybridSpec | None = None
    """Linear-attention layers (`hybrid`), or None when every layer has full attention."""

    mamba: MambaSpec | None = None
    """Nemotron-H's per-layer mixers (`mamba`), or None for attention + MLP in every layer."""

    vision: VisionSpec | None = None
    """The vision tower of a multimodal checkpoint (BF16 on both sides), or None."""

    prefix: str = "model"
    """Module path of the decoder ("model.language_model" in Qwen3.5's multimodal layout)."""

    hf_config: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    """The config.json it was read from (None when built field by field)."""

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
        """From the keys of a HuggingFace config.json: dense decoders (Llama, Qwen2/3), MoE
        (Qwen2/3-MoE, Mixtral, DeepSeek-V3/Moonlight), hybrid (Qwen3-Next, Qwen3.5 with its
        vision tower), Nemotron-H. Every problem is reported together, naming its key. Other
        models with state-space layers (Jamba, Falcon-H1, ...) raise `StateSpaceArch`."""
        label = str(name or config.get("_name_or_path") or config.get("model_type", "model"))
        if is_nemotron_h(config):  # one mixer per layer, counted by its pattern
            return ModelArch(name=label, hf_config=config, **nemotron_h_fields(Keys(config, label)))
        refuse_state_space(config, label)  # no transformer reading fits their layers
        text, prefix, vision, vk = config, "model", None, None
        if isinstance(config.get("text_config"), Mapping):
            # Multimodal layout (Qwen3.5): decoder under text_config, tower under vision_config.
            text, prefix = config["text_config"], "model.language_model"
            if isinstance(config.get("vision_config"), Mapping):
                vk = Keys(config["vision_config"], label)
                vision = read_vision(vk, f"model.{VISION_WORD}")
        keys = Keys(text, label)
        if vk is not None:
            keys.problems += [f"vision_config.{x}" for x in vk.problems]
        mt = str(text.get("model_type") or config.get("model_type") or "llama")
        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if text.get(k) is None
        ]
        if missing:
            raise ArchError(f"config of {label!r} lacks {', '.join(missing)}")
        hidden, layers = keys.int("hidden_size"), keys.int("num_hidden_layers")
        heads, vocab = keys.int("num_attention_heads"), keys.int("vocab_size")
        kv_heads = keys.int("num_key_value_heads", heads)
        keys.raise_if_any()
        moe = read_moe(keys, mt, layers)
        dense_layers = layers - (len(moe.moe_layers) if moe else 0)
        if text.get("intermediate_size") is None and (dense_layers or not moe):
            keys.problem("lacks intermediate_size (the dense MLP width)")
        inter = keys.int("intermediate_size", moe.expert_size if moe else 1)
        if mt not in _MLA and text.get("kv_lora_rank") is not None:
            # vLLM serves any model with these keys through its MLA attention, whose decode
            # absorbs kv_b_proj into BF16 W_UK_T/W_UV (arch.mla.KV_B_ABSORBED): read as plain
            # q/k/v, the verdict and the engine check would both call a BF16 product FP8
            raise ArchError(
                f"config of {label!r}: model_type {mt!r} has kv_lora_rank (multi-head latent "
                f"attention), which nemo_jetrl models for {', '.join(_MLA)} only; its verdict "
                "cannot be proven (use one of those model types' configs, or the local backend "
                "with a supported model)"
            )
        mla = read_mla(keys) if mt in _MLA else None
        hybrid = read_hybrid(keys, layers, split_proj=mt.startswith("qwen3_5"))
        keys.raise_if_any()
        head_dim = text.get("head_dim")
        if mla is not None:
            head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        elif not head_dim:
            if hidden % heads:
                raise ArchError(
                    f"config of {label!r}: hidden_size {hidden} is not divisible by "
                    f"num_attention_heads {heads} and head_dim is not set; set head_dim or make "
                    "hidden_size a multiple of num_attention_heads"
                )
            head_dim = hidden // heads
        bias_key = "qkv_bias" if mt == "qwen2_moe" else "attention_bias"
        attn_bias = bool(text.get(bias_key, mt in _QWEN2_BIAS))
        return ModelArch(
            name=label,
            model_type=mt,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            vocab_size=vocab,
            tie_word_embeddings=bool(
                config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            ),
            qkv_bias=attn_bias,
            qk_norm=mt in _QK_NORM,
            o_bias=attn_bias and mt not in _QWEN2_BIAS,
            output_gate=mt in _OUTPUT_GATE,
            moe=moe,
            mla=mla,
            hybrid=hybrid,
            vision=vision,
            prefix=prefix,
            hf_config=config,
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
            raise ArchError(f"model config not found: {p}{cwd_hint(p)}", key) from None
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
            kind = type(exc) if isinstance(exc, ArchError) else ArchError  # StateSpaceArch stays
            raise kind(f"model config {p}: {exc}", key) from None

    def to_hf_config(self) -> dict[str, Any]:
        """The HF config keys (enough for transformers' Auto*.from_config with model_type): the
        config.json it was read from, else the dense keys of its fields."""
        if self.hf_config is not None:
            return dict(self.hf_config)
        if self.moe or self.mla or self.hybrid or self.vision or self.mamba:
            raise ValueError(f"{self.name}: built field by field; no config.json to return")
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

    def layout_not_compared(self) -> str | None:
        """Why this model's layers may not be the ones read (a config.json of a model type
        outside `COMPARED_TYPES`); None for a compared type or a description built field by
        field."""
        if self.hf_config is None or self.model_type in COMPARED_TYPES:
            return None
        return (
            f"model_type {self.model_type!r} has not been compared with transformers' model: its "
            "layers are read as a Llama-style decoder's (self_attn.{q,k,v,o}_proj, "
            "mlp.{gate,up,down}_proj, or the MoE keys' experts), which may not be its own (phi3 "
            "fuses qkv_proj and gate_up_proj, starcoder2's MLP is c_fc/c_proj): the verdict's "
            "per-layer rows and per-name lists hold only if they are"
        )

    @property
    def family(self) -> str:
        """ "dense", "moe", "hybrid", "hybrid-moe", "mamba" or "mamba-moe" (what `jetrl check`
        prints)."""
        kinds = (("hybrid", self.hybrid), ("mamba", self.mamba), ("moe", self.moe))
        parts = [x for x, on in kinds if on]
        return "-".join(parts) or "dense"

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.moe_layers

    def kv_layers(self) -> list[int]:
        """Layers with a KV cache (full attention; linear attention and Mamba keep a recurrent
        state, MLP layers nothing)."""
        if self.mamba is not None:
            return self.mamba.layers_of(ATTENTION)
        h = self.hybrid
        return [i for i in range(self.num_layers) if h is None or not h.is_linear(i)]

    def layer_linears(self, layer: int) -> list[Linear]:
        """Every linear of decoder layer `layer`, in execution order."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range for {self.name} ({self.num_layers})")
        h, p = self.hidden_size, self.prefix
        if self.mamba is not None:  # one mixer per layer
            return self.mamba.layer_linears(self, layer)
        if self.hybrid is not None and self.hybrid.is_linear(layer):
            out = self.hybrid.linears(p, layer, h)
        elif self.mla is not None:
            out = self.mla.linears(p, layer, h, self.num_heads)
        else:
            out = attention_linears(
                p,
                layer,
                h,
                self.num_heads * self.head_dim,
                self.num_kv_heads * self.head_dim,
                qkv_bias=self.qkv_bias,
                o_bias=self.o_bias,
                output_gate=self.output_gate,
            )
        module = f"{p}.layers.{layer}.mlp"
        if self.moe is not None and layer in self.moe.moe_layers:
            return out + self.moe.block_linears(module, layer, h)
        return out + mlp_linears(module, layer, h, self.intermediate_size)

    def nondecoder_linears(self) -> list[Linear]:
        """The vision tower's layers (BF16 on both sides); empty for a text-only model."""
        return self.vision.linears() if self.vision else []

    def linears(self) -> list[Linear]:
        """Every decoder linear of every layer, the vision tower, then lm_head (BF16)."""
        out = [lin for i in range(self.num_layers) for lin in self.layer_linears(i)]
        out += self.nondecoder_linears()
        out.append(Linear("lm_head", "lm_head", None, self.hidden_size, self.vocab_size))
        return out

    def distinct_linears(self) -> list[Linear]:
        """One decoder linear per (group, kind, shape) that a recipe may run FP8, in model order
        (a dense model: the seven of layer 0)."""
        seen: dict[tuple, Linear] = {}
        for i in range(self.num_layers):
            for lin in self.layer_linears(i):
                if lin.fp8_capable:
                    seen.setdefault((lin.group, lin.kind, lin.in_features, lin.out_features), lin)
        return list(seen.values())

    def unaligned_linears(self) -> list[Linear]:
        """`distinct_linears` whose dims are not multiples of 128 (for fused experts: one
        expert's [out, in] matrix)."""
        return [lin for lin in self.distinct_linears() if not lin.aligned]

    def num_params(self) -> int:
        """Parameter count: linears, embeddings, RMSNorms of the dense trunk (2 per layer, the
        final one, q/k norms). Not counted: MLA's and linear attention's own norms and
        per-head vectors, the vision tower's norms."""
        lin = sum(x.numel for x in self.linears())
        norms = self.num_layers * (
            2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        )
        emb = self.vocab_size * self.hidden_size
        head = emb if not self.tie_word_embeddings else 0
        # lm_head is in linears(); a tied one shares the embedding's parameters.
        return lin - (self.vocab_size * self.hidden_size - head) + emb + norms + self.hidden_size
