"""Model architectures and the precision-flow check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_jetrl.arch import BUILTIN_ARCHS, ArchError, ModelArch, builtin_arch, resolve_arch
from nemo_jetrl.flow.check import (
    BF16,
    Edge,
    Precision,
    build_flow,
    check_on_policy,
    format_ranges,
    same_numbers,
)
from nemo_jetrl.flow.table import flow_table
from nemo_jetrl.recipe import PRESET_NAMES, Recipe, SideRecipe

QWEN3 = builtin_arch("Qwen/Qwen3-8B-Base")


@pytest.fixture(autouse=True)
def _clean_te_scale_env(monkeypatch):
    """Validation warns when the process environment sets TE's scale rule; other tests in the
    same process may have set it (nemo_jetrl.megatron does, on purpose)."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)


# The built-ins against real transformers models: tests/arch/test_arch_hf.py.


def test_from_hf_config_and_json(tmp_path):
    cfg = {
        "model_type": "qwen2",
        "hidden_size": 256,
        "intermediate_size": 200,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = ModelArch.from_json(tmp_path)
    assert arch.head_dim == 64 and arch.qkv_bias and arch.num_layers == 3
    # 200 is not a multiple of 128: gate/up/down are unaligned, attention is not.
    assert {lin.kind for lin in arch.unaligned_linears()} == {"gate_proj", "up_proj", "down_proj"}
    q = arch.layer_linears(0)[0]
    assert (q.kind, q.in_features, q.out_features) == ("q_proj", 256, 256)
    k = arch.layer_linears(2)[1]
    assert (k.name, k.out_features) == ("model.layers.2.self_attn.k_proj", 128)
    assert resolve_arch("anything", str(tmp_path / "config.json")) == arch
    assert resolve_arch(str(tmp_path)) == arch  # a local model directory


def test_arch_errors_name_the_problem(tmp_path):
    with pytest.raises(ArchError, match="lacks intermediate_size"):
        ModelArch.from_hf_config(
            {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 2}
        )
    with pytest.raises(ArchError, match="not found") as exc:
        ModelArch.from_json(tmp_path / "nope.json")
    assert exc.value.key == "jetrl.model_config"
    with pytest.raises(ArchError, match="multiple of num_key_value_heads"):
        ModelArch("x", "llama", 128, 128, 1, 6, 4, 32, 10)
    assert resolve_arch("org/unknown-model") is None
    assert builtin_arch("qwen/qwen3-8b-base") is QWEN3


# ------------------------------------------------------------------------------------- flows


@pytest.mark.parametrize("phase", ["rollout", "train_fwd"])
def test_forward_flow_has_every_linear_operand_and_kv(phase):
    flow = build_flow(QWEN3, Recipe.preset("jetrl_kv"), phase)
    n = QWEN3.num_layers
    linear = [e for e in flow.edges if e.group in ("attn", "mlp")]
    assert len(linear) == n * 7 * 2
    assert len([e for e in flow.edges if e.group == "kv"]) == 2 * n
    for e in linear:
        assert e.precision.is_fp8 and e.precision.fmt == "e4m3"
        assert e.precision.block == ((128, 128) if e.role == "weight" else (1, 128))
        assert e.precision.scale == "pow2"
    # embeddings and lm_head stay BF16 on every side
    assert all(e.precision == BF16 for e in flow.edges if e.group in ("embed", "lm_head"))
    assert "model.layers.0.self_attn.q_proj.weight" in flow.nodes()


def test_training_backward_blocks_and_hybrid_formats():
    r = Recipe.preset("jetrl").with_(train=SideRecipe(fp8_linears=True, fmt="hybrid"))
    bwd = build_flow(QWEN3, r, "train_bwd").by_key()
    fwd = build_flow(QWEN3, r, "train_fwd").by_key()
    op = "model.layers.5.mlp.down_proj"
    assert bwd[(op, "dgrad.grad_output")].precision.block == (1, 128)
    assert bwd[(op, "dgrad.grad_output")].precision.fmt == "e5m2"
    assert bwd[(op, "wgrad.grad_output")].precision.block == (128, 1)
    assert bwd[(op, "wgrad.input")].precision.block == (128, 1)
    assert bwd[(op, "wgrad.input")].precision.fmt == "e4m3"
    # DGrad reuses the forward's 128x128 weight blocks (transposed, no requantization).
    assert bwd[(op, "dgrad.weight")].precision == fwd[(op, "weight")].precision
    # hybrid changes only gradients: the forward is the same as e4m3's, so still on-policy.
    assert check_on_policy(QWEN3, r).on_policy


@pytest.mark.parametrize("name", list(BUILTIN_ARCHS))
@pytest.mark.parametrize(
    ("preset", "on_policy"),
    [("bf16", True), ("fp8_rollout", False), ("jetrl", True), ("jetrl_kv", True)],
)
def test_preset_verdicts(name, preset, on_policy):
    arch = BUILTIN_ARCHS[name]
    # MoE experts follow the side's quantizer (ours under jetrl); a vision tower: vLLM quantizes
    # it unless the rollout's per-name list names "visual"; MLA: vLLM's decode takes kv_b_proj's
    # product in BF16 (absorbed W_UK_T/W_UV), training runs it FP8 (issue 39).
    fp8_roll = preset in ("jetrl", "jetrl_kv")
    expected = on_policy and not ((arch.vision or arch.mla) and fp8_roll)
    assert check_on_policy(arch, Recipe.preset(preset)).on_policy is expected


def test_fp8_rollout_mismatch_says_why_and_which_keys():
    c = check_on_policy(QWEN3, Recipe.preset("fp8_rollout"))
    (m,) = c.mismatches
    assert "training keeps them in BF16" in m.reason
    assert m.keys == ("policy.megatron_cfg.fp8_cfg.enabled", "policy.generation.vllm_cfg.precision")
    assert m.layers == tuple(range(36)) and len(m.edges) == 36 * 7 * 2
    assert m.severity == "always"


def _fp32(quantizer):
    side = SideRecipe(fp8_linears=True, pow2_weight_scales=False, pow2_activation_scales=False)
    return Recipe(train=side, rollout=side.with_(quantizer=quantizer))


def test_fp32_scales_with_vllms_own_quantizer_are_off_policy():
    c = check_on_policy(QWEN3, _fp32("vllm"))
    assert not c.on_policy
    assert {m.operands for m in c.mismatches} == {
        ("attn weight", "mlp weight"),
        ("attn input", "mlp input"),
    }
    for m in c.mismatches:
        assert m.keys == ("jetrl.vllm_patch",) and m.fixes == ("jetrl.vllm_patch=true",)
        assert "RN(448/amax)" in m.reason and "RN(amax/448)" in m.reason
    # the same settings through our patch: identical formula, on-policy
    assert check_on_policy(QWEN3, _fp32("jetrl")).on_policy


def test_pow2_scales_with_vllms_own_quantizer_differ_only_rarely():
    r = Recipe.preset("jetrl").with_(rollout=Recipe.preset("jetrl").rollout.with_(quantizer="vllm"))
    c = check_on_policy(QWEN3, r)
    assert not c.on_policy
    assert {m.severity for m in c.mismatches} == {"rare"}
    assert any("1/512" in m.reason for m in c.mismatches)
    assert any("1e-4" in m.reason for m in c.mismatches)


def test_the_flow_claims_match_the_numerics():
    """What the check says about vLLM's own quantizer holds for the real formulas: FP32 scales
    differ from TE's on ordinary data, pow2 scales agree except on groups with amax < 1/512."""
    from nemo_jetrl.fp8 import quantize_blockwise
    from nemo_jetrl.fp8.vllm_native import quantize_group_native

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 1024, generator=g) * torch.logspace(-1, 2, 64)[:, None]).bfloat16()
    te32 = quantize_blockwise(x, (1, 128), pow2_scales=False).dequantize(torch.float32)
    vl32 = quantize_group_native(x, ue8m0=False).dequantize(torch.float32)
    assert (te32 != vl32).float().mean() > 0.05
    te2 = quantize_blockwise(x, (1, 128), pow2_scales=True).dequantize(torch.float32)
    vl2 = quantize_group_native(x, ue8m0=True).dequantize(torch.float32)
    assert torch.equal(te2, vl2)
    tiny = x[:4] * 1e-4  # every group's amax < 1/512
    assert not torch.equal(
        quantize_blockwise(tiny, (1, 128), pow2_scales=True).dequantize(torch.float32),
        quantize_group_native(tiny, ue8m0=True).dequantize(torch.float32),
    )


def test_scale_mode_mismatch_names_the_right_key():
    r = Recipe.preset("jetrl").with_(
        rollout=Recipe.preset("jetrl").rollout.with_(pow2_weight_scales=False)
    )
    (m,) = check_on_policy(QWEN3, r).mismatches
    assert m.operands == ("attn weight", "mlp weight")
    assert m.keys[0] == "policy.generation.vllm_cfg.pow2_weight_scaling_factors"
    assert m.fixes == ("policy.generation.vllm_cfg.pow2_weight_scaling_factors=true",)


def test_bf16_layers_must_agree():
    j = Recipe.preset("jetrl")
    r = j.with_(
        rollout=j.rollout.with_(bf16_first_layers=2), train=j.train.with_(bf16_last_layers=1)
    )
    ms = check_on_policy(QWEN3, r).mismatches
    by_layers = {m.layers: m for m in ms}
    assert set(by_layers) == {(0, 1), (35,)}
    assert by_layers[(0, 1)].keys[0] == "policy.generation.vllm_cfg.num_first_layers_in_bf16"
    assert by_layers[(0, 1)].fixes == ("policy.generation.vllm_cfg.num_first_layers_in_bf16=0",)
    assert by_layers[(35,)].fixes == ("policy.generation.vllm_cfg.num_last_layers_in_bf16=1",)
    same = j.with_(
        rollout=j.rollout.with_(bf16_first_layers=2), train=j.train.with_(bf16_first_layers=2)
    )
    assert check_on_policy(QWEN3, same).on_policy


def test_fp8_kv_without_onpolicy_kv_is_off_policy():
    r = Recipe.preset("jetrl_kv").with_(onpolicy_kv=False)
    (m,) = check_on_policy(QWEN3, r).mismatches
    assert m.keys[0] == "jetrl.onpolicy_kv" and m.fixes[0] == "jetrl.onpolicy_kv=true"
    assert m.operands == ("kv k_cache", "kv v_cache") and len(m.edges) == 72


def test_onpolicy_kv_needs_scales_the_trainer_knows():
    r = Recipe.preset("jetrl_kv").with_(kv_scale_source="dynamic")
    (m,) = check_on_policy(QWEN3, r).mismatches
    assert "jetrl.kv_scale_source" in m.keys
    assert check_on_policy(QWEN3, Recipe.preset("jetrl_kv").with_(kv_scale_source="unit")).on_policy


def test_unaligned_layers_stay_bf16_on_both_sides():
    toy = ModelArch("toy", "llama", 256, 204, 2, 2, 2, 128, 512)  # 204 % 8: TE refuses it
    r = Recipe.preset("jetrl").with_(unaligned_layers_bf16=True)
    roll = build_flow(toy, r, "rollout").by_key()
    assert roll[("model.layers.0.mlp.up_proj", "input")].precision == BF16
    assert roll[("model.layers.0.self_attn.q_proj", "input")].precision.is_fp8
    assert check_on_policy(toy, r).on_policy
    # 200 = 128 + 72: a partial block, FP8 on both sides (issue 39)
    toy = ModelArch("toy", "llama", 256, 200, 2, 2, 2, 128, 512)
    for phase in ("rollout", "train_fwd"):
        edges = build_flow(toy, r, phase).by_key()
        assert edges[("model.layers.0.mlp.up_proj", "input")].precision.is_fp8, phase
    assert check_on_policy(toy, r).on_policy


def test_extra_builders_plug_in_new_edges():
    """A further edge kind (here: Q entering FP8 attention) without editing flow.py."""
    from nemo_jetrl.flow.check import DEFAULT_BUILDERS

    def q_edges(arch, recipe, phase):
        if phase == "train_bwd":
            return []
        fp8 = recipe.kv_fp8 and (phase == "rollout" or recipe.onpolicy_kv)
        p = Precision("fp8", "e4m3", None, "trainer_calibrated", "jetrl") if fp8 else BF16
        return [
            Edge(f"model.layers.{i}.self_attn.attn", "q", i, "kv", "attn", p)
            for i in range(arch.num_layers)
        ]

    builders = (*DEFAULT_BUILDERS, q_edges)
    assert check_on_policy(QWEN3, Recipe.preset("jetrl_kv"), builders).on_policy
    ms = check_on_policy(QWEN3, Recipe.preset("jetrl_kv").with_(onpolicy_kv=False), builders)
    assert {op for m in ms.mismatches for op in m.operands} == {"kv k_cache", "kv v_cache", "kv q"}


def test_same_numbers_needs_the_same_formula():
    a = Precision("fp8", "e4m3", (1, 128), "fp32", "te")
    assert same_numbers(a, Precision("fp8", "e4m3", (1, 128), "fp32", "jetrl"))
    assert not same_numbers(a, Precision("fp8", "e4m3", (1, 128), "fp32", "vllm"))
    assert not same_numbers(a, Precision("fp8", "e4m3", (128, 128), "fp32", "te"))
    assert same_numbers(BF16, Precision("bf16"))


def test_flow_table_merges_layer_ranges():
    j = Recipe.preset("jetrl")
    r = j.with_(rollout=j.rollout.with_(bf16_last_layers=2))
    rows = flow_table(check_on_policy(QWEN3, r))
    attn = [row for row in rows if row[1] == "attn"]
    assert attn == [
        ("0-33", "attn", "FP8 e4m3 pow2 (te)", "FP8 e4m3 pow2 (jetrl)", "same"),
        ("34-35", "attn", "FP8 e4m3 pow2 (te)", "BF16", "DIFFERS"),
    ]
    assert format_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert format_ranges([]) == "-"


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_flows_are_deterministic(preset):
    r = Recipe.preset(preset)
    assert build_flow(QWEN3, r, "rollout") == build_flow(QWEN3, r, "rollout")


def test_check_config_validates_then_checks(tmp_path):
    from nemo_jetrl.config import ConfigError, load_config
    from nemo_jetrl.flow.pipeline import check_config

    ex = Path(__file__).resolve().parents[2] / "examples" / "configs"
    assert check_config(load_config(ex / "qwen3_8b_base" / "jetrl.yaml")).check.on_policy
    off = check_config(load_config(ex / "qwen3_8b_base" / "fp8_rollout.yaml")).check
    assert not off.on_policy and off.model == "Qwen/Qwen3-8B-Base"
    unknown = check_config(
        load_config(
            ex / "qwen3_8b_base" / "jetrl.yaml",
            ["policy.model_name=org/x", "policy.generation.vllm_cfg.num_last_layers_in_bf16=3"],
        )
    ).check
    assert unknown.rollout.edges and not unknown.on_policy
    assert {m.layers for m in unknown.mismatches} == {(1, 2, 3)}  # generic 4-layer stand-in
    with pytest.raises(ConfigError, match=r"jetrl\.nope"):
        check_config(load_config(ex / "qwen3_8b_base" / "jetrl.yaml", ["+jetrl.nope=1"]))


def test_mxfp8_rollout_against_blockwise_training_is_a_granularity_mismatch():
    """1x32 E8M0 blocks in the rollout vs TE's 1x128 / 128x128 in training: the verdict names the
    scaling granularity (and its keys), not only the scale rule."""
    jetrl = Recipe.preset("jetrl")
    r = jetrl.with_(rollout=jetrl.rollout.with_(scaling="mxfp8", quantizer="vllm"))
    check = check_on_policy(QWEN3, r)
    assert not check.on_policy
    reasons = [m.reason for m in check.mismatches]
    assert any("different FP8 scaling granularity" in x for x in reasons), reasons
    assert "policy.generation.vllm_cfg.is_mx" in check.keys


def test_tensorwise_training_against_blockwise_rollout_is_a_granularity_mismatch():
    """Same E4M3 format and scale rule, other blocks (one scale per tensor in training vs 1x128 /
    128x128 in the rollout): the quantized values differ, and the verdict says so."""
    jetrl = Recipe.preset("jetrl")
    r = jetrl.with_(train=jetrl.train.with_(scaling="tensorwise"))
    check = check_on_policy(QWEN3, r)
    assert not check.on_policy
    reasons = [m.reason for m in check.mismatches]
    assert any("different FP8 scaling granularity" in x for x in reasons), reasons
    assert "policy.megatron_cfg.fp8_cfg.fp8_recipe" in check.keys
