"""MXFP8 rollouts (issue 26 item 3): `check` says why they are off-policy, `align --recipe jetrl`
makes them on-policy with blockwise FP8 and says what changes (format, kernels, why)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from nemo_jetrl.arch import builtin_arch
from nemo_jetrl.config import load_config, recipe_from_config
from nemo_jetrl.flow.check import check_on_policy
from nemo_jetrl.flow.mxfp8 import TE_BLOCKWISE_RULE
from nemo_jetrl.recipe import Recipe
from nemo_jetrl.recipe_parts import SideRecipe

QWEN3 = builtin_arch("Qwen/Qwen3-8B-Base")
EX = Path(__file__).resolve().parents[2] / "examples" / "configs"
BASE = EX / "qwen3_8b_base" / "bf16.yaml"
# NeMo-RL main's grpo-qwen3-32b-*-mxfp8-rollout in one line: MXFP8 vLLM, BF16 Megatron, the
# attention projections kept BF16 by name in the rollout.
MX = [
    "policy.generation.vllm_cfg.precision=fp8",
    "+policy.generation.vllm_cfg.is_mx=true",
    "+policy.generation.vllm_cfg.quantization_ignored_layer_kws=[q_proj,k_proj,v_proj,o_proj]",
    "loss_fn.use_importance_sampling_correction=true",
]


def _mx_rollout(train: SideRecipe) -> Recipe:
    bf16 = Recipe.preset("bf16")
    rollout = SideRecipe(fp8_linears=True, scaling="mxfp8", quantizer="vllm")
    return bf16.with_(train=train, rollout=rollout)


def test_mxfp8_rollout_against_bf16_training_names_format_keys_and_remedy():
    check = check_on_policy(QWEN3, _mx_rollout(SideRecipe()))
    assert not check.on_policy
    (m,) = check.mismatches
    for needle in ("1x32", "E8M0", "is_mx=true", "1x128", "128x128", ">= 9.0", "CUDA >= 12.9"):
        assert needle in m.reason, (needle, m.reason)
    assert "policy.generation.vllm_cfg.is_mx" in m.keys
    assert "policy.generation.vllm_cfg.is_mx=false" in m.fixes
    assert "policy.megatron_cfg.fp8_cfg.enabled=true" in m.fixes


def test_te_mxfp8_training_is_not_called_fixable_by_the_blockwise_patch():
    """TE MXFP8 vs vLLM MXFP8: same blocks and scale rule, different code. The old text
    suggested jetrl.vllm_patch=true alone, which validation refuses with is_mx."""
    train = SideRecipe(fp8_linears=True, scaling="mxfp8", quantizer="te")
    check = check_on_policy(QWEN3, _mx_rollout(train))
    assert not check.on_policy
    (m,) = check.mismatches
    assert "blockwise FP8 only" in m.reason
    assert m.fixes != ("jetrl.vllm_patch=true",)
    assert "policy.megatron_cfg.fp8_cfg.fp8_recipe=blockwise" in m.fixes
    assert "policy.generation.vllm_cfg.is_mx=false" in m.fixes


def test_check_an_mxfp8_config_says_why(cli):
    code, out = cli("check", BASE, *MX)
    assert code == 1, out
    assert "rollout linears fp8 e4m3 mxfp8, scales e8m0 (1x32 blocks)" in out
    assert "FP8 e4m3 1x32 e8m0 [vllm]" in out
    assert "policy.generation.vllm_cfg.is_mx=true, vLLM's MXFP8 kernel" in out
    assert "verdict: OFF-POLICY" in out and "--recipe jetrl" in out


def test_align_recipe_jetrl_makes_mxfp8_on_policy_and_says_what_changes(cli, tmp_path):
    out_yaml = tmp_path / "aligned.yaml"
    code, out = cli("align", BASE, *MX, "--recipe", "jetrl", "-o", out_yaml)
    assert code == 0, out
    assert "verdict: ON-POLICY" in out
    assert "what changes (MXFP8 rollout, off-policy by construction):" in out
    assert "format: rollout MXFP8: E4M3 in 1x32 blocks with E8M0" in out
    assert "kernels: rollout: vLLM's block-FP8 linear with nemo_jetrl's vLLM patch" in out
    assert "training: TE's Float8BlockScaling GEMMs" in out
    assert TE_BLOCKWISE_RULE in out
    cfg = load_config(out_yaml)
    r = recipe_from_config(cfg)
    assert r.train.fp8_linears and r.train.scaling == "blockwise"
    assert r.rollout.fp8_linears and r.rollout.scaling == "blockwise"
    assert r.rollout.quantizer == "jetrl"
    assert OmegaConf.select(cfg, "policy.generation.vllm_cfg.is_mx") is False
    kws = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the user's BF16 list, now on both sides
    rollout_kws = OmegaConf.select(cfg, "policy.generation.vllm_cfg.quantization_ignored_layer_kws")
    assert list(rollout_kws) == kws
    assert list(OmegaConf.select(cfg, "jetrl.train_bf16_layer_kws")) == kws
    code, out = cli("check", out_yaml)
    assert code == 0 and "verdict: ON-POLICY" in out


def test_align_without_a_recipe_turns_the_mxfp8_rollout_bf16_and_says_so(cli, tmp_path):
    out_yaml = tmp_path / "bf16.yaml"
    code, out = cli("align", BASE, *MX, "-o", out_yaml)
    assert code == 0, out
    assert "it is now BF16 like training" in out and "`--recipe jetrl` keeps FP8" in out
    assert not recipe_from_config(load_config(out_yaml)).rollout.fp8_linears


def test_align_of_a_blockwise_config_prints_no_mxfp8_notes(cli, tmp_path):
    code, out = cli("align", EX / "nemo_rl_fp8_e2e.yaml", "-o", tmp_path / "a.yaml")
    assert code == 0 and "MXFP8" not in out
