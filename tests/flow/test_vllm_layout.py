"""The rollout-side block rule at vLLM ``tensor_parallel_size`` > 1 (`flow.vllm_layout`): a rank's
part of an FP8 linear must start and end on 128-block edges, or its blocks are not the HF
weight's (the refit quantizes full HF weights; vLLM's loaders cut codes and scales per rank).
Its cross-check against vLLM's own layer constructors and loaders is in
tests/vllm_patch/test_vllm_dense_shards_stacked.py (real vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nemo_jetrl.arch import ModelArch
from nemo_jetrl.flow.vllm_layout import rank_parts, vllm_block_problem, vllm_split_problems
from nemo_jetrl.recipe import Recipe

TP_KEY = "policy.generation.vllm_cfg.tensor_parallel_size"
LLAMA_1B = {  # Llama-3.2-1B's config.json sizes: head_dim 64, 8 KV heads
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "vocab_size": 128256,
}  # fmt: skip
QWEN3_4B = {  # Qwen3-4B's: MLP 9728 = 76 blocks
    "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936,
}  # fmt: skip
QWEN3_235B_ATTN = {  # Qwen3-235B-A22B's attention (4 KV heads of 128) on a dense stand-in MLP
    "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 2, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 151936,
}  # fmt: skip


def _arch(cfg: dict, name: str = "m") -> ModelArch:
    return ModelArch.from_hf_config(cfg, name=name)


def _settings(tp: int) -> SimpleNamespace:
    return SimpleNamespace(moe=SimpleNamespace(vllm_tp=tp))


JETRL = Recipe.preset("jetrl")


def _lin(arch: ModelArch, kind: str):
    return next(x for x in arch.distinct_linears() if x.kind == kind)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_aligned_splits_have_no_problem(tp):
    for cfg in (LLAMA_1B, QWEN3_4B, QWEN3_235B_ATTN):
        assert vllm_block_problem(_arch(cfg), _settings(tp), JETRL) is None


def test_replicated_kv_heads_hold_one_head_a_rank():
    arch = _arch(QWEN3_235B_ATTN)
    assert rank_parts(arch, _lin(arch, "k_proj"), 8) == [128]  # 4 heads on 8 ranks: replicated
    assert rank_parts(arch, _lin(arch, "k_proj"), 2) == [256]
    assert vllm_block_problem(arch, _settings(8), JETRL) is None  # one 128 head: whole blocks


def test_head_dim_64_at_tp_8_names_k_and_v_and_a_tp_that_fits():
    why = vllm_block_problem(_arch(LLAMA_1B, "Llama-3.2-1B"), _settings(8), JETRL)
    assert why is not None and why.startswith(f"{TP_KEY}=8 splits FP8 linears of Llama-3.2-1B")
    assert "self_attn.k_proj: 64 output rows a rank, not a multiple of 128" in why
    assert "self_attn.v_proj: 64 output rows a rank" in why
    assert "vLLM accepts the fused layer" in why and "refit refuses it" in why
    assert "q_proj" not in why and "o_proj" not in why  # 4 heads x 64 = 256 a rank
    assert f"Fix: set {TP_KEY}=4" in why


def test_mlp_split_off_a_block_names_gate_up_and_the_row_parallel_down():
    why = vllm_block_problem(_arch(QWEN3_4B, "Qwen3-4B"), _settings(8), JETRL)
    assert why is not None
    assert "mlp.gate_proj: 1216 output rows a rank" in why
    assert "mlp.down_proj: 1216 input columns a rank, not a multiple of 128: vLLM refuses" in why
    assert "activation blocks training never forms" in why
    assert f"set {TP_KEY}=4" in why


def test_a_linear_kept_bf16_in_the_rollout_is_not_judged():
    arch = _arch(QWEN3_4B)
    bf16_mlp = JETRL.with_(rollout=JETRL.rollout.with_(bf16_layer_kws=("mlp",)))
    assert vllm_split_problems(arch, bf16_mlp, 8) == []
    assert len(vllm_split_problems(arch, JETRL, 8)) == 3


def test_bf16_rollout_and_unknown_model_have_no_problem():
    assert vllm_block_problem(None, _settings(8), JETRL) is None
    assert vllm_block_problem(_arch(QWEN3_4B), _settings(8), Recipe.preset("bf16")) is None


def test_uneven_split_is_named():
    arch = _arch(QWEN3_4B)
    assert rank_parts(arch, _lin(arch, "k_proj"), 3) is None  # 8 KV heads on 3 ranks
    why = vllm_split_problems(arch, JETRL, 3)
    assert any("does not split evenly over 3 ranks" in w for w in why), why
