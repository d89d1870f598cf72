"""`jetrl check` judges Megatron's training blocks of Qwen3.5 / Qwen3-Next layouts (they were
skipped: `flow.megatron_layout` returned no fields for a hybrid model or a gated q_proj, so Qwen3.5
with its in_proj in FP8 on both sides was ON-POLICY on NeMo-RL).

megatron-core computes the gated delta net's q, k, v, z, b, a as ONE in_proj GEMM, one weight per
rank ``[q_r; k_r; v_r; z_r; b_r; a_r]`` that TE quantizes in 128-row blocks from row 0; the
rollout quantizes the HF weights each on its own. Qwen3.5's b and a (32 rows each) share a
training block the rollout splits into in_proj_b's and in_proj_a's: OFF-policy at any
tensor-parallel size until ``linear_attn.in_proj`` is BF16 on both sides. Qwen3-Next's b and a are
all of in_proj_ba, one block on both sides at TP 1, part of it a rank from TP 2. The rule itself:
tests/megatron/test_megatron_blocks_hybrid.py (quantized both ways on real megatron layouts).
"""

from __future__ import annotations

import pytest
from conftest import NEMO_RL_UPSTREAM
from test_megatron_layout import JETRL, NOT_ROLLOUTS, TP, _backends, _model

QWEN35 = "policy.model_name=Qwen/Qwen3.5-9B-Base"
ROLLOUT_KWS = "policy.generation.vllm_cfg.quantization_ignored_layer_kws"
TRAIN_KWS = "jetrl.train_bf16_layer_kws"
QWEN3_NEXT = {  # Qwen3-Next-80B-A3B's config.json sizes
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "vocab_size": 151936,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "tie_word_embeddings": False,
}
IN_PROJ_35 = "self_attention.in_proj (linear_attn.in_proj_qkv/in_proj_z/in_proj_b/in_proj_a)"


def _both(words: str) -> list[str]:
    return [f"+{TRAIN_KWS}={words}", f"+{ROLLOUT_KWS}={words}"]


def test_qwen35_in_proj_in_fp8_is_off_policy_on_nemo_rl_until_kept_bf16(cli):
    code, out = cli("check", JETRL, QWEN35, f"{TP}=1", *_both("[visual]"))  # tower BF16
    b = _backends(out)
    assert code == 1 and "verdict: OFF-POLICY on nemo-rl v0.7.0, nemo-rl main" in out, out
    assert b["local"].startswith("on-policy")  # HF layout, one weight per projection
    for tree in ("nemo-rl v0.7.0", "nemo-rl main"):
        assert b[tree].startswith(f"OFF-policy: {NOT_ROLLOUTS} {IN_PROJ_35}"), b[tree]
        assert "holds in_proj_b rows 0-31 + in_proj_a rows 0-31" in b[tree]
        assert "keep ['linear_attn.in_proj'] BF16 on both sides" in b[tree]
        assert "set policy.megatron_cfg.tensor_model_parallel_size" not in b[tree]  # no TP helps
        assert "linear_qkv" not in b[tree]  # head dim 256, 4 groups: the gated q/k/v fit
    code, out = cli("check", JETRL, QWEN35, *_both("[visual,linear_attn.in_proj]"))
    assert code == 0 and "verdict: ON-POLICY" in out and NOT_ROLLOUTS not in out, out


def test_align_keeps_qwen35_in_proj_bf16_on_both_sides(cli, tmp_path):
    code, out = cli("align", JETRL, QWEN35, "-o", tmp_path / "aligned.yaml")
    assert code == 0 and "verdict: ON-POLICY" in out.split("config: ")[-1], out
    assert f"  {TRAIN_KWS}: '<unset>' -> ['visual', 'linear_attn.in_proj']" in out, out
    assert "note: ['linear_attn.in_proj'] go BF16 on both sides" in out


def test_qwen3_next_in_proj_fits_at_tp_1_and_is_cut_from_tp_2(cli, tmp_path):
    model = _model(tmp_path, QWEN3_NEXT)
    code, out = cli("check", JETRL, model, f"{TP}=1")
    assert code == 0 and "verdict: ON-POLICY" in out and NOT_ROLLOUTS not in out, out
    code, out = cli("check", JETRL, model, f"{TP}=2")
    main = _backends(out)["nemo-rl main"]
    assert code == 1 and main.startswith(f"OFF-policy: {NOT_ROLLOUTS} self_attention.in_proj"), out
    assert (
        "(linear_attn.in_proj_qkvz/in_proj_ba)" in main
        and "at tensor_model_parallel_size=2" in main
    )
    assert "holds in_proj_ba rows 0-31 (the rollout's block: in_proj_ba rows 0-63)" in main
    assert "set policy.megatron_cfg.tensor_model_parallel_size so each rank" in main


def test_gated_attention_with_head_dim_64_names_linear_qkv(cli, tmp_path):
    """q_proj holds [q; gate] per head; Megatron's linear_qkv [q heads | gate heads | k | v] per
    group: 64-row heads put two of them in one of TE's blocks."""
    code, out = cli("check", JETRL, _model(tmp_path, {**QWEN3_NEXT, "head_dim": 64}))
    main = _backends(out)["nemo-rl main"]
    assert code == 1 and main.startswith(f"OFF-policy: {NOT_ROLLOUTS} self_attention.linear_qkv")
    assert "head_dim=64" in main and "[q heads | gate heads | k | v]" in main, main
    assert "q_proj ([q; gate] per head)" in main


def test_nemo_rls_qwen35_fp8_config_with_in_proj_fp8_on_both_sides_is_off_policy(cli):
    """NeMo-RL main's Qwen3.5-9B FP8 recipe (Megatron TP 4) with its flow mismatches fixed but
    in_proj FP8 on both sides: the precision flow is the same, the blocks are not."""
    path = NEMO_RL_UPSTREAM / "main-7ea279a" / "examples/configs/recipes/llm"
    path = path / "grpo-qwen3.5-9b-1n8g-megatron-fp8.yaml"
    if not path.is_file():
        pytest.skip(f"NeMo-RL's shipped config not found: {path}")
    words = "[linear_attn.conv1d,visual]"
    fixes = [f"++{ROLLOUT_KWS}={words}", f"+{TRAIN_KWS}={words}", "+jetrl.vllm_patch=true"]
    code, out = cli("check", path, *fixes)
    flow = out.split("per backend (precision):")[0]
    assert "DIFFERS" not in flow, flow
    b = _backends(out)
    assert code == 1 and b["local"].startswith("on-policy"), out
    assert b["nemo-rl main"].startswith(f"OFF-policy: {NOT_ROLLOUTS} {IN_PROJ_35}")
    assert "= 512 + 512 + 1024 + 1024 + 8 + 8 rows a rank" in b["nemo-rl main"]
