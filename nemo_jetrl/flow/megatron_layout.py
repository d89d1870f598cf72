"""Whether NeMo-RL's Megatron training quantizes the rollout's 128x128 blocks, from the model's
shape and the config's tensor-parallel sizes, before anything runs.

The rule itself is `nemo_jetrl.megatron.blocks` (TE quantizes each rank's local tensor of a
fused ``linear_qkv`` / ``linear_fc1``, so a head dim off 128 or a shard edge inside a block
gives training blocks the rollout never has); it reads Megatron ``TransformerConfig`` fields.
This module hands it those fields from a `ModelArch` and the config's
``policy.megatron_cfg.tensor_model_parallel_size`` / ``expert_tensor_parallel_size``, so
`jetrl check` names the problem where NeMo-RL's worker would otherwise build the model first.
Hybrid models (Qwen3.5, Qwen3-Next) get the fields Megatron-Bridge sets for them: the attention
output gate, the gated delta net's sizes and layers (``linear_attention_freq``, 1 = linear
attention), and which HF weights its in_proj is (``hf_in_proj_split``, no TransformerConfig
field: `blocks.HF_SPLIT_FIELD`).
The local backend trains the HF layout (one weight per projection, no tensor parallelism) and
is not affected.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from nemo_jetrl.arch import ModelArch
from nemo_jetrl.config import Settings
from nemo_jetrl.megatron.blocks import (
    GDN_VARIANT,
    HF_SPLIT_FIELD,
    block_layout_problem,
    block_layout_words,
)
from nemo_jetrl.recipe import Recipe


def transformer_fields(arch: ModelArch, tp: int = 1, etp: int | None = None) -> SimpleNamespace:
    """The ``TransformerConfig`` fields `block_layout_problems` reads, from ``arch`` (every
    family we describe is SwiGLU-gated)."""
    f: dict[str, Any] = {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_heads,
        "num_query_groups": arch.num_kv_heads,
        "kv_channels": arch.head_dim,
        "attention_output_gate": arch.output_gate,
        "ffn_hidden_size": arch.intermediate_size,
        "gated_linear_unit": True,
        "tensor_model_parallel_size": tp,
        "expert_tensor_parallel_size": tp if etp is None else etp,
        "multi_latent_attention": arch.mla is not None,
    }
    if arch.mla is not None:
        f.update(
            qk_head_dim=arch.mla.qk_nope_head_dim,
            qk_pos_emb_head_dim=arch.mla.qk_rope_head_dim,
            v_head_dim=arch.mla.v_head_dim,
            q_lora_rank=arch.mla.q_lora_rank,
        )
    if arch.moe is not None:
        f.update(
            num_moe_experts=arch.moe.num_experts,
            moe_ffn_hidden_size=arch.moe.expert_size,
            moe_shared_expert_intermediate_size=arch.moe.shared_size,
            moe_layer_freq=[int(i in arch.moe.moe_layers) for i in range(arch.num_layers)],
        )
    hybrid = arch.hybrid
    if hybrid is not None:
        f.update(
            experimental_attention_variant=GDN_VARIANT,
            linear_attention_freq=[int(hybrid.is_linear(i)) for i in range(arch.num_layers)],
            linear_num_key_heads=hybrid.num_k_heads,
            linear_key_head_dim=hybrid.k_head_dim,
            linear_num_value_heads=hybrid.num_v_heads,
            linear_value_head_dim=hybrid.v_head_dim,
            linear_conv_kernel_dim=hybrid.conv_kernel,
        )
        f[HF_SPLIT_FIELD] = hybrid.split_proj
    return SimpleNamespace(**f)


def _fields(arch: ModelArch | None, settings: Settings, recipe: Recipe) -> SimpleNamespace | None:
    """The fields to judge, or None where there is nothing to judge."""
    if arch is None or not recipe.rollout.fp8_linears or arch.mamba is not None:
        return None  # Nemotron-H's Megatron layout is not modelled: `flow.support` refuses FP8
    return transformer_fields(arch, settings.megatron_tp, settings.megatron_etp)


def megatron_block_problem(
    arch: ModelArch | None, settings: Settings, recipe: Recipe
) -> str | None:
    """Why Megatron's FP8 training blocks are not this recipe's FP8 rollout blocks (None: they
    are, or a side is BF16, or no model shape is known)."""
    fields = _fields(arch, settings, recipe)
    return None if fields is None else block_layout_problem(fields, recipe.train)


def megatron_block_words(
    arch: ModelArch | None, settings: Settings, recipe: Recipe
) -> tuple[tuple[str, ...], bool]:
    """(per-name words keeping BF16 on both sides the dense linears `megatron_block_problem`
    names, whether they settle every one: experts cannot be kept BF16 by name); what
    `jetrl align` adds."""
    fields = _fields(arch, settings, recipe)
    return ((), True) if fields is None else block_layout_words(fields, recipe.train)
