"""Every model type `ModelArch.from_hf_config` claims to read (`arch.model.COMPARED_TYPES`) is
compared with transformers' own model, weight for weight; a config.json of any other type is read
as a Llama-style decoder, and an FP8 check says so (a warning naming the key)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_arch_hf import (
    _arch_params,
    _build,
    _tiny_deepseek,
    _tiny_linear_attn,
    _tiny_minimax_m2,
    _tiny_qwen3_moe,
    assert_matches_real,
)

from nemo_jetrl.arch import ModelArch
from nemo_jetrl.arch.model import COMPARED_TYPES
from nemo_jetrl.flow.pipeline import check_config

pytest.importorskip("transformers")

E2E = Path(__file__).resolve().parents[2] / "examples" / "configs" / "nemo_rl_fp8_e2e.yaml"
BF16 = [
    "policy.generation.vllm_cfg.precision=bfloat16",
    "policy.megatron_cfg.fp8_cfg.enabled=false",
]
DENSE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 64,
}
MOE = {"moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2}


def _tiny(model_type: str) -> dict:
    """A tiny config.json of ``model_type`` with each of its families' layer kinds."""
    if model_type == "qwen2_moe":  # Qwen2-MoE's shared expert and its gate
        return _tiny_qwen3_moe(model_type=model_type, shared_expert_intermediate_size=128)
    if model_type == "qwen3_moe":
        return _tiny_qwen3_moe()
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return _tiny_deepseek(model_type=model_type)
    if model_type == "minimax_m2":
        return _tiny_minimax_m2()
    if model_type == "mixtral":
        return {"model_type": "mixtral", **DENSE, "num_local_experts": 3, "num_experts_per_tok": 2}
    if model_type == "nemotron_h":  # every mixer kind (tests/arch/test_arch_nemotron_h.py)
        return {
            "model_type": model_type,
            **DENSE,
            "num_hidden_layers": 4,
            "hybrid_override_pattern": "M*-E",
            "mamba_num_heads": 4,
            "mamba_head_dim": 32,
            "n_groups": 2,
            "ssm_state_size": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "moe_shared_expert_intermediate_size": 128,
        }
    if model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        moe = MOE if "moe" in model_type or model_type == "qwen3_next" else {}
        extra = {"shared_expert_intermediate_size": 128} if moe else {}
        return _tiny_linear_attn(model_type=model_type, full_attention_interval=2, **moe, **extra)
    return {"model_type": model_type, **DENSE}


# The list, written out: each one's comparison below is a test of its own.
TYPES = (
    *("deepseek_v2", "deepseek_v3", "gemma", "gemma2", "gemma3_text", "granite", "llama"),
    *(
        "minimax_m2",
        "mistral",
        "mixtral",
        "nemotron_h",
        "olmo2",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_5_moe_text",
    ),
    *("qwen3_5_text", "qwen3_moe", "qwen3_next"),
)


def test_the_compared_types_are_the_ones_compared_here():
    assert set(COMPARED_TYPES) == set(TYPES) and len(TYPES) == len(set(TYPES))


@pytest.mark.parametrize("model_type", TYPES)
def test_every_compared_type_is_transformers_model_weight_for_weight(model_type):
    arch = assert_matches_real(_tiny(model_type))
    assert arch.model_type == model_type and arch.layout_not_compared() is None


@pytest.mark.parametrize(
    ("model_type", "missed", "invented"),
    [
        # measured with transformers 5.24: what a Llama-style reading gets wrong for each
        ("phi3", "self_attn.qkv_proj.weight", "self_attn.q_proj.weight"),
        ("starcoder2", "mlp.c_fc.weight", "mlp.gate_proj.weight"),
        ("arcee", None, "mlp.gate_proj.weight"),
    ],
)
def test_types_outside_the_list_are_read_wrong_and_flagged(model_type, missed, invented, tmp_path):
    cfg = {
        "model_type": model_type,
        **DENSE,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    arch = ModelArch.from_hf_config(cfg)
    real = {n for n, _ in _build(cfg, "meta").named_parameters()}
    ours = set(_arch_params(arch))
    layer0 = f"{arch.prefix}.layers.0."
    assert missed is None or (layer0 + missed in real and layer0 + missed not in ours)
    assert layer0 + invented in ours and layer0 + invented not in real
    assert arch.layout_not_compared().startswith(f"model_type {model_type!r} has not been compared")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    fp8 = check_config(str(E2E), [f"+jetrl.model_config={path}"])
    (warning,) = [i for i in fp8.issues if "has not been compared" in i.message]
    assert (warning.path, warning.level) == ("jetrl.model_config", "warning")
    bf16 = check_config(str(E2E), [*BF16, f"+jetrl.model_config={path}"])
    assert not [i for i in bf16.issues if "has not been compared" in i.message]  # nothing to align


def test_qwen3_moe_has_no_shared_expert_whatever_its_config_json_says():
    # transformers' Qwen3-MoE ignores shared_expert_intermediate_size; Qwen2-MoE builds one
    arch = assert_matches_real(_tiny_qwen3_moe(shared_expert_intermediate_size=128))
    assert arch.moe.shared_size == 0
    qwen2 = assert_matches_real(_tiny("qwen2_moe"))
    assert qwen2.moe.shared_size == 128


def test_builtins_and_described_models_carry_no_warning():
    c = check_config(str(E2E))
    assert c.arch.model_type == "llama" and not [i for i in c.issues if "compared" in i.message]
