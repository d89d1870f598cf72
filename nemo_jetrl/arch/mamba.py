"""Nemotron-H: one mixer per layer, Mamba-2, attention, a squared-ReLU MLP or experts.

A Nemotron-H layer (``model_type`` ``nemotron_h``: Nemotron-H 8B/47B/56B, Nemotron Nano 9B/12B
v2, Nemotron 3 Nano/Super) is a norm and ONE mixer, ``model.layers.{i}.mixer``, chosen by the
pattern: ``hybrid_override_pattern`` (one character per layer) or transformers 5's
``layers_block_type`` (one word per layer):

    M  "linear_attention" (older: "mamba")   Mamba-2: in_proj, conv1d, scan, gated norm, out_proj
    *  "full_attention" (older: "attention") q/k/v/o_proj, no bias, no RoPE-specific weights
    -  "mlp"                                 up_proj, squared ReLU, down_proj (no gate)
    E  "moe"                                 router, non-gated experts, shared experts

A Mamba-2 mixer with d = mamba_num_heads * mamba_head_dim and gs = n_groups * ssm_state_size:

    in_proj  [d (z) + d (x) + 2*gs (B, C) + mamba_num_heads (dt), hidden]   (bias: use_bias)
    conv1d   depthwise over x, B, C: [d + 2*gs, 1, conv_kernel]             (bias: use_conv_bias)
    out_proj [hidden, d]

(``dt_bias``, ``A_log``, ``D`` are per-head vectors and the gated norm a [d] weight: not
GEMMs.) The experts are up/down only, [E, I, latent] and [E, latent, I] where Nemotron 3 Super
projects tokens into a ``moe_latent_size`` space first (``fc1_latent_proj`` [latent, hidden],
``fc2_latent_proj`` [hidden, latent]; without it latent = hidden). The router is DeepSeek-V3's:
sigmoid scores, a correction bias, grouped top-k. Names are transformers 5.24's, compared
weight for weight with its NemotronH (hub checkpoints say ``backbone.`` for ``model.``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nemo_jetrl.arch.dense import attention_linears, mlp_linears
from nemo_jetrl.arch.keys import Keys
from nemo_jetrl.arch.linear import CONV_BF16, ArchError, Linear
from nemo_jetrl.arch.moe import MoeSpec

MAMBA = "M"
ATTENTION = "*"
MLP = "-"
MOE = "E"
# layers_block_type's words (transformers 5.24 and the older remote-code spellings).
PATTERN_CHAR = {
    "linear_attention": MAMBA,
    "mamba": MAMBA,
    "full_attention": ATTENTION,
    "attention": ATTENTION,
    "mlp": MLP,
    "moe": MOE,
}
MIXER = "mixer"
NEMOTRON_H_TYPES = frozenset({"nemotron_h"})
ROUTING = "sigmoid scores with a correction bias, grouped top-k (Nemotron-H)"


@dataclass(frozen=True)
class MambaSpec:
    """Which mixer each layer has, and the Mamba-2 mixer's sizes."""

    pattern: str
    """One character per layer: M (Mamba-2), * (attention), - (MLP), E (experts)."""

    num_heads: int
    """Mamba heads (`mamba_num_heads`)."""

    head_dim: int
    """Per-head width (`mamba_head_dim`)."""

    n_groups: int
    """B/C groups (`n_groups`)."""

    state_size: int
    """SSM state per group (`ssm_state_size`)."""

    conv_kernel: int = 4
    """Depthwise convolution width (`conv_kernel`)."""

    proj_bias: bool = False
    """in_proj/out_proj biases (`use_bias`)."""

    conv_bias: bool = True
    """conv1d bias (`use_conv_bias`)."""

    mlp_bias: bool = False
    """MLP, shared-expert and latent-projection biases (`mlp_bias`)."""

    @property
    def inner(self) -> int:
        """d = mamba_num_heads * mamba_head_dim (z, x and out_proj's input)."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of conv1d: x, B and C."""
        return self.inner + 2 * self.n_groups * self.state_size

    def layers_of(self, char: str) -> list[int]:
        return [i for i, c in enumerate(self.pattern) if c == char]

    def counted(self) -> str:
        """ "52 layers, 23 Mamba-2, 6 attention, 23 MoE": what the pattern holds."""
        kinds = ((MAMBA, "Mamba-2"), (ATTENTION, "attention"), (MLP, "MLP"), (MOE, "MoE"))
        parts = [f"{self.pattern.count(c)} {what}" for c, what in kinds if c in self.pattern]
        return ", ".join([f"{len(self.pattern)} layers", *parts])

    def mixer_linears(self, prefix: str, layer: int, hidden: int) -> list[Linear]:
        """A Mamba-2 mixer's in_proj, conv1d and out_proj, in execution order."""
        p, b = f"{prefix}.layers.{layer}.{MIXER}", self.proj_bias
        in_width = self.inner + self.conv_dim + self.num_heads
        conv = Linear(
            f"{p}.conv1d",
            "conv1d",
            layer,
            1,
            self.conv_dim,
            self.conv_bias,
            group="mamba",
            bf16_why=CONV_BF16,
            kernel=(self.conv_kernel,),
        )
        return [
            Linear(f"{p}.in_proj", "in_proj", layer, hidden, in_width, b, group="mamba"),
            conv,
            Linear(f"{p}.out_proj", "out_proj", layer, self.inner, hidden, b, group="mamba"),
        ]

    def layer_linears(self, arch: Any, layer: int) -> list[Linear]:
        """Layer ``layer``'s one mixer of ``arch`` (a `ModelArch`), in execution order."""
        h, p, char = arch.hidden_size, arch.prefix, self.pattern[layer]
        module = f"{p}.layers.{layer}.{MIXER}"
        if char == MAMBA:
            return self.mixer_linears(p, layer, h)
        if char == ATTENTION:
            q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
            return attention_linears(p, layer, h, q, kv, module=MIXER)
        if char == MOE:
            return arch.moe.block_linears(module, layer, h)
        return mlp_linears(
            module, layer, h, arch.intermediate_size, gated=False, bias=self.mlp_bias
        )


def is_nemotron_h(config: Any) -> bool:
    """A config.json `nemotron_h_fields` reads (not the other state-space families)."""
    return isinstance(config, Mapping) and config.get("model_type") in NEMOTRON_H_TYPES


def _pattern(keys: Keys) -> str:
    """The per-layer pattern from hybrid_override_pattern or layers_block_type."""
    given = keys.config.get("hybrid_override_pattern")
    if given is None:
        words = keys.config.get("layers_block_type")
        if not isinstance(words, list) or not words:
            keys.problem(
                "needs hybrid_override_pattern (one of M * - E per layer) or layers_block_type "
                f"(one of {sorted(PATTERN_CHAR)} per layer)"
            )
            return ""
        bad = sorted({str(w) for w in words if w not in PATTERN_CHAR})
        if bad:
            keys.problem(f"layers_block_type has unknown {bad}: use {sorted(PATTERN_CHAR)}")
            return ""
        return "".join(PATTERN_CHAR[w] for w in words)
    if not isinstance(given, str) or not given or set(given) - set(PATTERN_CHAR.values()):
        keys.problem(
            f"hybrid_override_pattern={given!r}: expected one character per layer, each "
            "M (Mamba-2), * (attention), - (MLP) or E (experts)"
        )
        return ""
    return given


def nemotron_h_fields(keys: Keys) -> dict[str, Any]:
    """`ModelArch` fields (all but name and hf_config) of a nemotron_h config.json; every
    problem is reported together, naming its key. transformers counts the layers by the
    pattern, so num_hidden_layers may be absent."""
    c = keys.config
    missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size") if not keys.has(k)]
    if missing:
        raise ArchError(f"config of {keys.label!r} lacks {', '.join(missing)}")
    hidden, heads = keys.int("hidden_size"), keys.int("num_attention_heads")
    pattern = _pattern(keys)
    n = c.get("num_hidden_layers")
    if pattern and isinstance(n, int) and n != len(pattern):
        keys.problem(
            f"num_hidden_layers={n} but the pattern has {len(pattern)} layers (transformers "
            "counts the pattern): make them agree"
        )
    if pattern and ATTENTION not in pattern:
        keys.problem("the pattern has no attention layer (*): not a Nemotron-H hybrid")
    spec = MambaSpec(
        pattern,
        keys.int("mamba_num_heads"),
        keys.int("mamba_head_dim"),
        keys.int("n_groups", 8),
        keys.int("ssm_state_size"),
        keys.int("conv_kernel", 4),
        bool(c.get("use_bias", False)),
        bool(c.get("use_conv_bias", True)),
        bool(c.get("mlp_bias", False)),
    )
    moe = None
    if MOE in pattern:
        num, top_k = keys.int("n_routed_experts"), keys.int("num_experts_per_tok")
        if top_k > num:
            keys.problem(f"num_experts_per_tok={top_k} exceeds n_routed_experts={num}")
        moe = MoeSpec(
            num,
            top_k,
            keys.int("moe_intermediate_size"),
            frozenset(spec.layers_of(MOE)),
            keys.int("moe_shared_expert_intermediate_size", 0, minimum=0),
            "shared_experts",
            ROUTING,
            gated=False,
            latent_size=keys.int("moe_latent_size", 0, minimum=0),
            bias=spec.mlp_bias,
        )
    if MLP in pattern and not keys.has("intermediate_size"):
        keys.problem("lacks intermediate_size (the width of the '-' layers' MLP)")
    if not keys.has("head_dim") and hidden % heads:
        keys.problem(f"head_dim is missing and hidden_size {hidden} % {heads} heads != 0")
    fields = {
        "model_type": str(c["model_type"]),
        "hidden_size": hidden,
        "intermediate_size": keys.int("intermediate_size", moe.expert_size if moe else 1),
        "num_layers": len(pattern) or 1,
        "num_heads": heads,
        "num_kv_heads": keys.int("num_key_value_heads", heads),
        "head_dim": keys.int("head_dim", hidden // heads),
        "vocab_size": keys.int("vocab_size"),
        "tie_word_embeddings": bool(c.get("tie_word_embeddings", False)),
        "moe": moe,
        "mamba": spec,
    }
    keys.raise_if_any()
    return fields
