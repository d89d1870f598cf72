"""The flow per group for the MoE and hybrid families (`flow/groups.py`, `flow/graph.py`)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from nemo_jetrl.arch import builtin_arch
from nemo_jetrl.config import settings_of
from nemo_jetrl.flow.check import check_on_policy
from nemo_jetrl.flow.graph import build_flow
from nemo_jetrl.flow.groups import group_verdicts, routing_note
from nemo_jetrl.recipe import Recipe

QWEN3_MOE = builtin_arch("Qwen/Qwen3-30B-A3B")
MOONLIGHT = builtin_arch("moonshotai/Moonlight-16B-A3B-Instruct")
QWEN35 = builtin_arch("Qwen/Qwen3.5-35B-A3B-Base")


def _by_group(arch, preset):
    return {g.group: g for g in group_verdicts(check_on_policy(arch, Recipe.preset(preset)))}


def test_moe_groups_under_jetrl_experts_same_router_bf16():
    g = _by_group(QWEN3_MOE, "jetrl")
    assert list(g) == ["embed", "kv", "attn", "router", "experts", "lm_head"]
    assert g["attn"].same and "FP8" in g["attn"].train
    assert g["router"].same and g["router"].train == g["router"].rollout == "BF16"
    # Our experts kernel in the rollout (quantizer jetrl) vs TE's grouped linear in training.
    assert g["experts"].same
    assert "(jetrl)" in g["experts"].rollout and "(te)" in g["experts"].train
    # fp8_rollout: vLLM's own FusedMoE quantizer in the rollout.
    f = _by_group(QWEN3_MOE, "fp8_rollout")
    assert not f["experts"].same and "(vllm)" in f["experts"].rollout
    assert g["experts"].layers == "0-47"


def test_moe_bf16_is_same_everywhere_and_dense_first_layer_is_mlp():
    g = _by_group(MOONLIGHT, "bf16")
    assert all(v.same for v in g.values())
    assert g["mlp"].layers == "0" and g["experts"].layers == "1-26"
    assert g["shared_experts"].layers == "1-26"


def test_hybrid_groups_kv_only_on_full_attention_and_vision_bf16():
    flow = build_flow(QWEN35, Recipe.preset("jetrl_kv"), "rollout")
    kv_layers = sorted({e.layer for e in flow.edges if e.group == "kv"})
    assert kv_layers == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39]
    conv = [e for e in flow.edges if e.kind == "conv1d"]
    assert conv and all(not e.precision.is_fp8 for e in conv)
    # vLLM quantizes the vision tower unless the rollout's list names "visual".
    vision = [e for e in flow.edges if e.group == "vision"]
    assert vision and all(e.precision.is_fp8 for e in vision)
    train = build_flow(QWEN35, Recipe.preset("jetrl_kv"), "train_fwd")
    assert all(not e.precision.is_fp8 for e in train.edges if e.group == "vision")
    check = check_on_policy(QWEN35, Recipe.preset("jetrl"))
    g = {v.group: v for v in group_verdicts(check)}
    assert g["linear_attn"].same and not g["vision"].same and g["vision"].layers == "-"
    assert {"router", "experts", "shared_experts", "attn"} <= set(g)
    why = [m for m in check.mismatches if any(op.startswith("vision") for op in m.operands)]
    assert why and "names 'visual'" in why[0].reason
    # a setting to paste (`flow.fixes`), not an instruction to edit the list by hand
    assert why[0].fixes == ("policy.generation.vllm_cfg.quantization_ignored_layer_kws=['visual']",)
    kept = Recipe.preset("jetrl")
    kept = kept.with_(rollout=kept.rollout.with_(bf16_layer_kws=("visual",)))
    g = {v.group: v for v in group_verdicts(check_on_policy(QWEN35, kept))}
    assert g["vision"].same and g["vision"].rollout == "BF16"


@pytest.mark.parametrize(("value", "word"), [(True, "REPLAYED"), (None, "NOT replayed")])
def test_routing_note_reads_router_replay(value, word):
    cfg = settings_of(OmegaConf.create({"policy": {"router_replay": {"enabled": value}}}))
    note = routing_note(cfg, QWEN3_MOE)
    assert word in note and "jetrl/moe/routing_mismatch" in note
    assert routing_note(cfg, builtin_arch("Qwen/Qwen3-32B")) is None


EX = "examples/configs/qwen3_8b_base"


def test_check_fp8_moe_with_shared_experts_same_under_jetrl(cli):
    """Shared experts are dense linears on each side's dense quantizer: under jetrl (ours in the
    rollout, TE in training) the group is the same, and no refusal names them any more."""
    code, out = cli(
        "check",
        f"{EX}/jetrl.yaml",
        "policy.model_name=moonshotai/Moonlight-16B-A3B-Instruct",
        "++jetrl.unaligned_layers=bf16",
    )
    # exit 0, or 1 naming a backend whose vLLM the experts kernel does not cover: never 2
    assert code in (0, 1), out
    assert "jetrl check: error" not in out and "shared experts (" not in out
    assert "verdict per group:" in out and "NOT replayed" in out
    row = next(x for x in out.splitlines() if x.lstrip().startswith("shared experts"))
    assert row.split()[2:4] == ["1-26", "same"] and "(te)" in row and "(jetrl)" in row


def test_qwen_shared_expert_gate_bf16_on_both_sides():
    """Qwen3.5-MoE's [1, hidden] shared_expert_gate is BF16 on both sides under every FP8
    recipe (vLLM builds it without quant_config; Megatron applies gate_weight with torch), while
    the shared expert's projections follow the recipe."""
    from nemo_jetrl.arch.moe import SHARED_GATE_BF16

    for preset in ("jetrl", "fp8_rollout"):
        check = check_on_policy(QWEN35, Recipe.preset(preset))
        edges = [e for e in check.rollout.edges if e.group == "shared_experts"]
        gate = [e for e in edges if e.op.endswith(".shared_expert_gate")]
        assert gate and all(not e.precision.is_fp8 for e in gate)
        train = check.train_fwd.by_key()
        assert all(not train[e.key].precision.is_fp8 for e in gate)
        assert any(e.precision.is_fp8 for e in edges if ".shared_expert." in e.op)
    g = _by_group(QWEN35, "jetrl")
    assert g["shared_experts"].same and "BF16" in g["shared_experts"].rollout
    assert not _by_group(QWEN35, "fp8_rollout")["shared_experts"].same
    assert "quant_config" in SHARED_GATE_BF16


def test_check_fp8_moe_without_shared_experts_is_on_policy_per_backend(cli):
    code, out = cli(
        "check",
        f"{EX}/jetrl.yaml",
        "policy.model_name=Qwen/Qwen3-30B-A3B",
        "+policy.router_replay.enabled=true",
    )
    assert code == 0, out  # both NeMo-RL trees' vLLM (0.20.0, 0.25.1) run our experts kernel
    assert "experts     0-47    same" in out and "REPLAYED" in out
    assert "local: on-policy" in out and "nemo-rl v0.7.0: on-policy" in out
    assert "nemo-rl main: on-policy" in out and "OFF-POLICY" not in out


def test_check_bf16_moe_with_router_replay_is_on_policy(cli):
    code, out = cli(
        "check",
        f"{EX}/bf16.yaml",
        "policy.model_name=moonshotai/Moonlight-16B-A3B-Instruct",
        "+policy.router_replay.enabled=true",
    )
    assert code == 0, out
    assert "Moonlight-16B-A3B-Instruct (27 layers" in out and "heads 16/16; moe)" in out
    assert "shared experts  1-26" in out and "dense MLP       0 " in out
    assert "REPLAYED (policy.router_replay.enabled=true)" in out


def test_dense_r1_distill_is_not_refused_as_moe():
    from nemo_jetrl.flow.support import moe_evidence

    cfg = {"policy": {"model_name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"}}
    assert moe_evidence(settings_of(cfg)) == []
    cfg = {"policy": {"model_name": "deepseek-ai/DeepSeek-R1"}}
    assert moe_evidence(settings_of(cfg))


def test_check_json_has_groups_and_routing(cli):
    import json

    code, out = cli("check", f"{EX}/bf16.yaml", "policy.model_name=Qwen/Qwen3-30B-A3B", "--json")
    d = json.loads(out)
    assert code == 0 and d["family"] == "moe"
    assert [g["group"] for g in d["groups"]] == [
        "embed",
        "kv",
        "attn",
        "router",
        "experts",
        "lm_head",
    ]
    assert d["routing"].startswith("routing (128 experts, top-8, 48 MoE layers): NOT replayed")


def test_unaligned_linears_kept_bf16_by_name_on_both_sides_need_no_tiling(cli):
    # NeMo-RL's Qwen3.5 lists name linear_attn.in_proj_a/b (32 x hidden); megatron-core computes
    # them with in_proj_qkv/z as ONE in_proj GEMM, so no training list can keep only them BF16:
    # refused in the training list, a named mismatch in the rollout list (vLLM can do it; exit
    # 1), both naming the word true on both sides. Their 32x4096 dims are not the problem
    # (partial 128-blocks run FP8, issue 39).
    words = "[linear_attn.conv1d,linear_attn.in_proj_a,linear_attn.in_proj_b,visual]"
    base = (f"{EX}/jetrl.yaml", "policy.model_name=Qwen/Qwen3.5-9B-Base")
    code, out = cli(
        "check", *base, f"+policy.generation.vllm_cfg.quantization_ignored_layer_kws={words}"
    )
    assert code == 1 and "one in_proj GEMM" in out and "in_proj_b 32x4096" not in out
    code, out = cli(
        "check",
        *base,
        f"+policy.generation.vllm_cfg.quantization_ignored_layer_kws={words}",
        f"+jetrl.train_bf16_layer_kws={words}",
    )
    assert code == 2, out
    line = next(x for x in out.splitlines() if "jetrl.train_bf16_layer_kws:" in x)
    assert "one in_proj GEMM" in line and "use 'linear_attn.in_proj'" in line
    assert "  - policy.generation.vllm_cfg.quantization_ignored_layer_kws:" not in out  # a warning
    whole = "[linear_attn.conv1d,linear_attn.in_proj,visual]"
    code, out = cli(
        "check",
        *base,
        f"+policy.generation.vllm_cfg.quantization_ignored_layer_kws={whole}",
        f"+jetrl.train_bf16_layer_kws={whole}",
    )
    assert code == 0, out
    assert "linear attention  0-2, 4-6" in out and "vision tower      -" in out


def test_moonlight_a_proj_b_proj_words_match_its_mla_linears():
    from nemo_jetrl.recipe_parts import SideRecipe

    side = SideRecipe(bf16_layer_kws=("a_proj", "b_proj"))
    kept = {x.kind for x in MOONLIGHT.linears() if side.keeps_bf16(x.name)}
    assert kept == {"kv_a_proj_with_mqa", "kv_b_proj"}  # Moonlight has no q LoRA
    kept = {
        x.kind for x in builtin_arch("deepseek-ai/DeepSeek-V3").linears() if side.keeps_bf16(x.name)
    }
    assert kept == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}


@pytest.mark.parametrize(
    ("model", "words", "split"),
    [
        ("Qwen/Qwen3.5-9B-Base", "[linear_attn.in_proj_a]", "['in_proj_a'] of layer 0"),
        ("deepseek-ai/DeepSeek-V3", "[kv_a_proj_with_mqa]", "['kv_a_proj_with_mqa'] of layer 0"),
    ],
)
def test_half_of_a_vllm_fused_group_kept_bf16_is_refused(cli, model, words, split):
    key = "policy.generation.vllm_cfg.quantization_ignored_layer_kws"
    code, out = cli("check", f"{EX}/bf16.yaml", f"policy.model_name={model}", f"+{key}={words}")
    assert code == 2 and key in out and split in out and "one fused GEMM" in out


def test_moonlight_without_q_lora_keeps_kv_a_proj_alone(cli):
    # No q_a_proj in Moonlight: its kv_a_proj_with_mqa is not fused with anything in vLLM.
    key = "policy.generation.vllm_cfg.quantization_ignored_layer_kws"
    code, out = cli(
        "check",
        f"{EX}/bf16.yaml",
        "policy.model_name=moonshotai/Moonlight-16B-A3B-Instruct",
        f"+{key}=[a_proj,b_proj]",
    )
    assert code == 0 and "fused GEMM" not in out, out
