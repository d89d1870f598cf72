"""The local backend refuses MoE blocks with shared experts by name (issue 28): its `MoeBlock`
computes routed experts only, so swapping in a Qwen2-MoE block would silently drop the shared
expert and its gate (transformers 5's real Qwen2MoeForCausalLM here)."""

from __future__ import annotations

import pytest
import torch
from hf_models import tiny_hf_config, tiny_hf_model

from nemo_jetrl.backends.local.moe import convert_moe_blocks, moe_blocks
from nemo_jetrl.recipe import Recipe


def _qwen2_moe(shared: int):
    cfg = tiny_hf_config(
        "qwen2_moe",
        hidden_size=128,
        intermediate_size=128,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=shared,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        mlp_only_layers=[],
    )
    return tiny_hf_model(cfg, seed=0, dtype=torch.bfloat16)


@pytest.mark.parametrize("preset", ["bf16", "jetrl"])
def test_qwen2_moe_with_a_shared_expert_is_refused_naming_it(preset):
    model = _qwen2_moe(256)
    side = Recipe.preset(preset).train
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.shared_expert: shared experts"):
        convert_moe_blocks(model, side, None)
    assert moe_blocks(model) == []  # nothing was swapped
    assert type(model.model.layers[0].mlp).__name__ == "Qwen2MoeSparseMoeBlock"
