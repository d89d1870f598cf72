"""config.json numbers of the MoE, hybrid, Nemotron-H and large dense models NeMo-RL's GRPO
configs name.

Each entry holds the keys `ModelArch.from_hf_config` reads, with the values of the model's
public config.json on the HuggingFace hub (no network here: written from those files and
cross-checked against the defaults of transformers 5.24's config classes, which follow the
flagship checkpoints, and vLLM's model code). Where each set comes from is said beside it;
what could not be cross-checked is said too.
"""

from __future__ import annotations

from typing import Any

_QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "head_dim": 128,
    "vocab_size": 151936,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
    "attention_bias": False,
}

# Qwen/Qwen3-30B-A3B: 48 layers, 32/4 heads, 128 experts of 768, top-8 (its config.json;
# transformers' Qwen3MoeConfig defaults share experts, top-k, head_dim and vocab).
QWEN3_30B_A3B = {
    **_QWEN3_MOE,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
}

# Qwen/Qwen3-235B-A22B: 94 layers, 64/4 heads, 128 experts of 1536, top-8 (its config.json).
QWEN3_235B_A22B = {
    **_QWEN3_MOE,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
}

_MLA = {
    "model_type": "deepseek_v3",
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "moe_layer_freq": 1,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

# deepseek-ai/DeepSeek-V3 (and -R1, same shapes): its config.json; equal to transformers'
# DeepseekV3Config defaults key for key.
DEEPSEEK_V3 = {
    **_MLA,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "n_group": 8,
    "topk_group": 4,
    "vocab_size": 129280,
}

# moonshotai/Moonlight-16B-A3B(-Instruct): its config.json (model_type deepseek_v3, DeepSeek-V2-
# Lite's shape: no q LoRA, 64 experts of 1408 + 2 shared, top-6, first layer dense).
MOONLIGHT_16B_A3B = {
    **_MLA,
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "q_lora_rank": None,
    "n_group": 1,
    "topk_group": 1,
    "vocab_size": 163840,
}

# Qwen/Qwen3-32B: its config.json.
QWEN3_32B = {
    "model_type": "qwen3",
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}

_QWEN35_LINEAR = {
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "full_attention_interval": 4,
    "vocab_size": 248320,
    "attention_bias": False,
}


def _vision(out_hidden: int) -> dict[str, Any]:
    # transformers 5.24's Qwen3_5VisionConfig defaults (27 blocks of 1152, patch 16). The
    # merger's output feeds the decoder's token stream, so out_hidden_size is the text
    # hidden_size (the class default 3584 is not any Qwen3.5 decoder's width).
    return {
        "model_type": "qwen3_5_vision",
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": out_hidden,
        "num_position_embeddings": 2304,
    }


# Qwen/Qwen3.5-9B(-Base): transformers 5.24's Qwen3_5TextConfig defaults (32 layers of 4096,
# 16/4 heads of 256, every 4th layer full attention). Not cross-checked against the hub file.
QWEN35_9B = {
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        **_QWEN35_LINEAR,
        "model_type": "qwen3_5_text",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
    "vision_config": _vision(4096),
}

# Qwen/Qwen3.5-35B-A3B(-Base): transformers 5.24's Qwen3_5MoeTextConfig defaults (40 layers of
# 2048, 256 experts of 512 + a shared one of 512, top-8, every layer MoE). Not cross-checked
# against the hub file.
QWEN35_35B_A3B = {
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        **_QWEN35_LINEAR,
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 256,
        "num_experts_per_tok": 8,
    },
    "vision_config": _vision(2048),
}

# MiniMaxAI/MiniMax-M2 (-M2.5, -M2.7 share the layout): transformers 5.24's MiniMaxM2Config
# defaults (62 layers of 3072, 48/8 heads of 128, 256 experts of 1536, top-8, every layer MoE,
# Mixtral-style `mlp.gate` + `mlp.experts`; vocab 200064). The hub files are not readable here,
# so M2.5's and M2.7's own numbers are not cross-checked: set jetrl.model_config to the
# checkpoint's config.json where they differ. Not linears, so not recorded: the sigmoid router's
# e_score_correction_bias (a buffer), q_norm/k_norm over all heads, and the partial rotary
# (`rotary_dim`), none of which changes a linear's shape.
MINIMAX_M2 = {
    "model_type": "minimax_m2",
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "num_hidden_layers": 62,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_local_experts": 256,
    "num_experts_per_tok": 8,
    "vocab_size": 200064,
    "tie_word_embeddings": False,
}

# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B(-Base)-BF16: 52 layers by its hybrid_override_pattern
# (23 Mamba-2, 23 MoE, 6 attention), 128 non-gated experts of 1856, top-6, one shared expert of
# 3712 (its config.json, as quoted alike by several public repositories; transformers 5.24's
# NemotronHConfig defaults follow another checkpoint and could not cross-check it; the 31.6B
# total its model card states is what `ModelArch.num_params` gives).
NEMOTRON3_NANO_30B_A3B = {
    "model_type": "nemotron_h",
    "hidden_size": 2688,
    "num_hidden_layers": 52,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "intermediate_size": 1856,
    "n_routed_experts": 128,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "vocab_size": 131072,
    "use_bias": False,
    "use_conv_bias": True,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}

# nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16: 88 layers (40 Mamba-2, 40 MoE, 8 attention),
# 512 non-gated experts of 2688 reading a 1024-wide latent space, top-22, one shared expert of
# 5376 (its config.json as a public repository quotes it; the counts and sizes agree with a
# second, and the 120.7B total `ModelArch.num_params` gives with the card's 120B). Its one
# multi-token-prediction layer (num_nextn_predict_layers) is not part of the policy's forward.
NEMOTRON3_SUPER_120B_A12B = {
    **NEMOTRON3_NANO_30B_A3B,
    "hidden_size": 4096,
    "num_hidden_layers": 88,
    "hybrid_override_pattern": (
        "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
    ),
    "mamba_num_heads": 128,
    "intermediate_size": 2688,
    "n_routed_experts": 512,
    "num_experts_per_tok": 22,
    "moe_intermediate_size": 2688,
    "moe_latent_size": 1024,
    "moe_shared_expert_intermediate_size": 5376,
}

CATALOG: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-30B-A3B": QWEN3_30B_A3B,
    "Qwen/Qwen3-30B-A3B-Base": QWEN3_30B_A3B,
    "Qwen/Qwen3-235B-A22B": QWEN3_235B_A22B,
    "deepseek-ai/DeepSeek-V3": DEEPSEEK_V3,
    "deepseek-ai/DeepSeek-R1": DEEPSEEK_V3,
    "moonshotai/Moonlight-16B-A3B": MOONLIGHT_16B_A3B,
    "moonshotai/Moonlight-16B-A3B-Instruct": MOONLIGHT_16B_A3B,
    "Qwen/Qwen3-32B": QWEN3_32B,
    "Qwen/Qwen3.5-9B": QWEN35_9B,
    "Qwen/Qwen3.5-9B-Base": QWEN35_9B,
    "Qwen/Qwen3.5-35B-A3B": QWEN35_35B_A3B,
    "Qwen/Qwen3.5-35B-A3B-Base": QWEN35_35B_A3B,
    "MiniMaxAI/MiniMax-M2": MINIMAX_M2,
    "MiniMaxAI/MiniMax-M2.5": MINIMAX_M2,
    "MiniMaxAI/MiniMax-M2.7": MINIMAX_M2,
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": NEMOTRON3_NANO_30B_A3B,
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16": NEMOTRON3_NANO_30B_A3B,
    "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16": NEMOTRON3_SUPER_120B_A12B,
}
"""HF repo id -> config.json keys."""
