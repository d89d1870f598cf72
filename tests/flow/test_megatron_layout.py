"""`jetrl check` names a model whose Megatron training blocks are not the rollout's (training-side
review, session 38; the rule: `nemo_jetrl.megatron.blocks`, checked on a real TransformerConfig in
tests/megatron/test_megatron_blocks.py). Megatron fuses q/k/v into one ``linear_qkv`` interleaved
per KV group and TE quantizes each rank's local tensor from row 0: with head_dim 64 (Llama-3.2-1B,
Qwen2.5-0.5B) a 128-row block holds a group's K and V rows, where the rollout quantizes k_proj and
v_proj each on its own; at tensor-parallel size 8 Qwen3-4B's 9728-row MLP gives 1216 rows a rank,
so block edges fall inside the rollout's blocks. Both were ON-POLICY on NeMo-RL; the local backend
(HF layout, no tensor parallelism) is not affected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JETRL = REPO / "examples" / "configs" / "qwen3_8b_base" / "jetrl.yaml"
LLAMA_1B = {  # Llama-3.2-1B's config.json sizes
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
}
QWEN3_4B = {  # Qwen3-4B's
    "model_type": "qwen3",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
TP = "policy.megatron_cfg.tensor_model_parallel_size"
NOT_ROLLOUTS = "TE's blockwise FP8 training blocks are not the rollout's for"


def _model(tmp_path: Path, fields: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return f"+jetrl.model_config={path}"


def _backends(out: str) -> dict[str, str]:
    lines = out.split("per backend (precision):\n", 1)[1].splitlines()
    return dict(x.strip().split(": ", 1) for x in lines if x.startswith("  ") and ": " in x)


def test_head_dim_64_is_off_policy_on_nemo_rl_and_on_policy_locally(cli, tmp_path):
    code, out = cli("check", JETRL, _model(tmp_path, LLAMA_1B))
    assert code == 1 and "verdict: OFF-POLICY on nemo-rl v0.7.0, nemo-rl main" in out, out
    b = _backends(out)
    assert b["local"].startswith("on-policy")
    for tree in ("nemo-rl v0.7.0", "nemo-rl main"):
        assert b[tree].startswith(f"OFF-policy: {NOT_ROLLOUTS} self_attention.linear_qkv"), b
        assert "head_dim=64" in b[tree] and "mix K and V" in b[tree]


def test_keeping_q_k_v_bf16_on_both_sides_by_name_is_on_policy(cli, tmp_path):
    words = "[self_attn.q_proj,self_attn.k_proj,self_attn.v_proj]"
    code, out = cli(
        "check",
        JETRL,
        _model(tmp_path, LLAMA_1B),
        f"+jetrl.train_bf16_layer_kws={words}",
        f"+policy.generation.vllm_cfg.quantization_ignored_layer_kws={words}",
    )
    assert code == 0 and NOT_ROLLOUTS not in out, out


@pytest.mark.parametrize(("tp", "off"), [(1, False), (4, False), (8, True)])
def test_a_tensor_parallel_shard_cutting_blocks_is_off_policy(cli, tmp_path, tp, off):
    # 9728 / 4 = 2432 = 19 x 128 rows a rank; 9728 / 8 = 1216 = 9.5 x 128
    code, out = cli("check", JETRL, _model(tmp_path, QWEN3_4B), f"{TP}={tp}")
    b = _backends(out)
    assert (NOT_ROLLOUTS in b["nemo-rl main"]) == off, out
    if off:
        assert code == 1 and "9728 rows per projection / tensor_model_parallel_size=8" in out
        assert "mlp.linear_fc2 (mlp.down_proj)" in out and b["local"].startswith("on-policy")


def test_a_bf16_rollout_is_not_judged_by_training_blocks(cli, tmp_path):
    bf16 = REPO / "examples" / "configs" / "qwen3_8b_base" / "bf16.yaml"
    code, out = cli("check", bf16, _model(tmp_path, LLAMA_1B))
    assert code == 0 and NOT_ROLLOUTS not in out, out


def test_align_keeps_those_linears_bf16_and_is_on_policy(cli, tmp_path):
    out_yaml = tmp_path / "aligned.yaml"
    code, out = cli("align", JETRL, _model(tmp_path, LLAMA_1B), "-o", out_yaml)
    qkv = "['self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj']"
    assert code == 0 and f"  jetrl.train_bf16_layer_kws: '<unset>' -> {qkv}" in out, out
    assert f"note: {qkv} go BF16 on both sides" in out and "verdict: ON-POLICY" in out
    code, out = cli(
        "align", JETRL, _model(tmp_path, QWEN3_4B), f"{TP}=8", "-o", out_yaml, "--force"
    )
    mlp = "['mlp.gate_proj', 'mlp.up_proj', 'mlp.down_proj']"
    assert f"  jetrl.train_bf16_layer_kws: '<unset>' -> {mlp}" in out, out
    assert NOT_ROLLOUTS not in out.split("per backend (precision):")[1]


def test_align_names_experts_it_cannot_keep_bf16_by_name(cli, tmp_path):
    # Qwen3-30B-A3B's 768-row experts over expert_tensor_parallel_size=4: 192 rows a rank
    code, out = cli(
        "align",
        JETRL,
        "policy.model_name=Qwen/Qwen3-30B-A3B",
        "+policy.megatron_cfg.expert_tensor_parallel_size=4",
        "-o",
        tmp_path / "aligned.yaml",
    )
    assert code == 1 and "verdict: OFF-POLICY on nemo-rl v0.7.0, nemo-rl main" in out, out
    assert "note: routed or shared experts' Megatron training blocks are not the rollout's" in out
    assert "768 rows per projection / expert_tensor_parallel_size=4 = 192" in out, out


def test_the_local_backends_own_model_is_not_judged_by_cluster_layouts(cli):
    """The local configs' model (head_dim 64, built from jetrl.local.model_config, never on the
    hub) stays ON-POLICY everywhere: NeMo-RL cannot load it (a first version of the rule called
    `jetrl check examples/configs/local/jetrl.yaml` OFF-POLICY, the README's own config)."""
    local = REPO / "examples" / "configs" / "local" / "jetrl.yaml"
    code, out = cli("check", local)
    assert code == 0 and NOT_ROLLOUTS not in out and "verdict: ON-POLICY" in out, out


def test_vllms_tensor_parallel_split_off_blocks_is_off_policy_on_nemo_rl(cli, tmp_path):
    # Qwen3-4B at vLLM TP 8: down_proj's 9728 input columns give 1216 a rank (vLLM refuses the
    # engine), gate/up 1216 rows a rank; at TP 4 every part is 19 x 128
    model = _model(tmp_path, QWEN3_4B)
    vtp = "policy.generation.vllm_cfg.tensor_parallel_size"
    code, out = cli("check", JETRL, model, f"{vtp}=8")
    b = _backends(out)
    assert code == 1 and f"{vtp}=8 splits FP8 linears" in b["nemo-rl main"], out
    assert b["local"].startswith("on-policy")
    code, out = cli("check", JETRL, model, f"{vtp}=4")
    assert code == 0 and "splits FP8 linears" not in out, out


def test_a_parallel_size_that_is_no_integer_is_refused_naming_it(cli):
    """A string "8" (an unresolved env default) was read as tensor-parallel 1 by the block-grid
    rule and judged ON-POLICY (diff review, session 38): the keys are typed counts now."""
    for key in (TP, "policy.generation.vllm_cfg.tensor_parallel_size"):
        code, out = cli("check", JETRL, f"++{key}='8'")
        assert code == 2 and f"  - {key}: got '8'; expected an integer" in out, out
