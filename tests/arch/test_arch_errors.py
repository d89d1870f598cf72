"""Bad MoE / hybrid descriptions: refused together, naming the config.json key, and through
`jetrl check` with exit 2 naming the YAML key before any work starts."""

from __future__ import annotations

import json

import pytest

from nemo_jetrl.arch import ArchError, ModelArch

EX = "examples/configs/qwen3_8b_base"


def _moe(**kw) -> dict:
    return {
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 512,
        **kw,
    }


def _hybrid(**kw) -> dict:
    return {
        "model_type": "qwen3_5_text",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "vocab_size": 512,
        **kw,
    }


@pytest.mark.parametrize(
    ("cfg", "needles"),
    [
        (_moe(num_experts_per_tok=9), ["num_experts_per_tok=9 exceeds num_experts=8"]),
        (_moe(num_experts=0), ["num_experts=0", "remove num_experts for a dense model"]),
        (_moe(mlp_only_layers=[0, 4]), ["mlp_only_layers has [4]", "0..3"]),
        (_moe(decoder_sparse_step=0), ["decoder_sparse_step=0: expected an integer >= 1"]),
        (
            _moe(num_experts_per_tok=9, mlp_only_layers=[7], moe_intermediate_size=-1),
            ["num_experts_per_tok=9", "mlp_only_layers has [7]", "moe_intermediate_size=-1"],
        ),
        (
            {
                **_moe(
                    model_type="deepseek_v3",
                    n_routed_experts=6,
                    n_group=4,
                    topk_group=5,
                    kv_lora_rank=64,
                    qk_nope_head_dim=32,
                    qk_rope_head_dim=32,
                    v_head_dim=32,
                    first_k_dense_replace=9,
                )
            },
            [
                "n_routed_experts=6 is not a multiple of n_group=4",
                "topk_group=5 exceeds n_group=4",
                "first_k_dense_replace=9 exceeds num_hidden_layers=4",
            ],
        ),
        (_moe(model_type="deepseek_v3", n_routed_experts=4), ["kv_lora_rank is missing"]),
        (_hybrid(layer_types=["linear_attention"] * 3), ["layer_types has 3 entries", "=4"]),
        (
            _hybrid(layer_types=["linear_attention", "sliding", "full_attention", "mamba"]),
            ["layer_types has unknown ['mamba', 'sliding']"],
        ),
        (
            _hybrid(layer_types=["linear_attention"] * 4, linear_num_value_heads=3),
            ["linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"],
        ),
    ],
)
def test_bad_descriptions_are_refused_together_naming_the_key(cfg, needles):
    with pytest.raises(ArchError) as exc:
        ModelArch.from_hf_config(cfg, name="m")
    for n in needles:
        assert n in str(exc.value), str(exc.value)


def test_mixtral_zero_local_experts_names_its_own_key():
    cfg = _moe(model_type="mixtral", num_local_experts=0)
    del cfg["num_experts"]
    with pytest.raises(ArchError, match="num_local_experts=0"):
        ModelArch.from_hf_config(cfg)


def test_cli_bad_moe_config_json_exits_2_naming_both_keys(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_moe(num_experts_per_tok=12)))
    code, out = cli("check", f"{EX}/bf16.yaml", f"+jetrl.model_config={tmp_path}/config.json")
    assert code == 2 and "Traceback" not in out
    assert "jetrl.model_config" in out and "num_experts_per_tok=12 exceeds num_experts=8" in out
    assert "precision flow" not in out  # refused before any work


def test_cli_unaligned_experts_refused_like_dense_linears(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_moe(moe_intermediate_size=96)))
    path = f"+jetrl.model_config={tmp_path}/config.json"
    code, out = cli("check", f"{EX}/jetrl.yaml", path)
    assert code == 2
    assert "policy.megatron_cfg.fp8_cfg.enabled" in out
    assert "mlp.experts.gate_up_proj 192x256" in out and "no per-name word keeps routed" in out
    assert "jetrl.unaligned_layers=bf16" not in out  # NeMo-RL does not read it
    code, out = cli("check", f"{EX}/bf16.yaml", path)  # BF16: nothing to tile
    assert code == 0, out


def test_vision_and_text_problems_are_reported_together():
    cfg = {
        "model_type": "qwen3_5",
        "text_config": {**_hybrid(), "vocab_size": "many", "num_key_value_heads": 0},
        "vision_config": {"depth": 0, "hidden_size": 64, "intermediate_size": 128},
    }
    with pytest.raises(ArchError) as exc:
        ModelArch.from_hf_config(cfg, name="m")
    msg = str(exc.value)
    for n in (
        "vision_config.depth=0",
        "vision_config.out_hidden_size is missing",
        "vocab_size='many'",
        "num_key_value_heads=0",
    ):
        assert n in msg, msg
