"""Config keys <-> Recipe mapping (presets round-trip, align's minimal updates) and every shipped
example YAML: it loads, validates and gets its verdict."""

from __future__ import annotations

import pytest
from config_files import (
    EXAMPLES,
    cfg_with,
    clean_te_scale_env,  # noqa: F401 (autouse, for this module)
    issue_paths,
)
from omegaconf import OmegaConf

from nemo_jetrl.config import (
    ConfigError,
    errors,
    load_config,
    merge_updates,
    minimal_updates,
    recipe_from_config,
    recipe_to_config_updates,
    validate,
)
from nemo_jetrl.recipe import PRESET_NAMES, Recipe, preset_differences

# ------------------------------------------------------------------------------ key mapping


def test_keys_map_onto_the_recipe():
    r = recipe_from_config(
        cfg_with(
            "policy.megatron_cfg.fp8_cfg.enabled=true",
            "policy.megatron_cfg.fp8_cfg.fp8=hybrid",
            "policy.megatron_cfg.fp8_cfg.fp8_param=true",
            "policy.megatron_cfg.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES='1'",
            "policy.generation.vllm_cfg.precision=fp8",
            "policy.generation.vllm_cfg.num_last_layers_in_bf16=2",
            "policy.generation.vllm_cfg.use_deep_gemm=true",
            "policy.generation.vllm_cfg.kv_cache_dtype=fp8_e4m3",
            "jetrl.vllm_patch=true",
            "jetrl.kv_calibration.enabled=false",
            "jetrl.train_num_first_layers_in_bf16=1",
        )
    )
    t, ro = r.train, r.rollout
    assert (t.fp8_linears, t.fmt, t.fp8_param, t.quantizer) == (True, "hybrid", True, "te")
    assert t.scale_mode("weight") == t.scale_mode("activation") == "fp32"
    assert t.bf16_first_layers == 1
    assert ro.fp8_linears and ro.quantizer == "jetrl" and ro.use_deep_gemm
    # Under the patch the weights' scale rule covers activations too.
    assert ro.scale_mode("weight") == ro.scale_mode("activation") == "fp32"
    assert ro.bf16_last_layers == 2
    assert r.kv_fp8 and r.kv_scale_source == "dynamic" and not r.onpolicy_kv
    assert not r.kv_calibration.enabled


def test_patch_refuses_nemo_rl_pow2_activation_patch():
    """NeMo-RL's own activation patch (v0.7.0: crashes vLLM start-up) must stay off under ours."""
    key = "policy.generation.vllm_cfg.pow2_activation_scaling_factors"
    base = ("policy.generation.vllm_cfg.precision=fp8", f"{key}=true")
    msgs = [str(i) for i in errors(validate(cfg_with(*base, "jetrl.vllm_patch=true")))]
    assert any(m.startswith(key) and "must be false" in m for m in msgs), msgs
    r = recipe_from_config(cfg_with(*base, "jetrl.vllm_patch=false"))
    assert r.rollout.scale_mode("activation") == "pow2"  # vLLM's own quantizer: key as written


def test_numeric_env_var_value_is_accepted():
    r = recipe_from_config(
        cfg_with(
            "policy.megatron_cfg.fp8_cfg.enabled=true",
            "policy.megatron_cfg.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1",
        )
    )
    assert r.train.scale_mode("weight") == "fp32"


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_round_trips_through_config_keys(name):
    preset = Recipe.preset(name)
    cfg = merge_updates(cfg_with(), recipe_to_config_updates(preset))
    assert errors(validate(cfg)) == []
    back = recipe_from_config(cfg)
    assert preset_differences(back, preset) == []
    if preset.rollout.fp8_linears:  # a BF16 rollout's scale flags are not written (no effect)
        assert back == preset


def test_align_of_a_bf16_rollout_never_arms_nemo_rls_activation_patch():
    """pow2_activation_scaling_factors=true turns on NeMo-RL v0.7.0's own activation patch
    (crashes its vLLM start-up with FP8); a BF16 rollout must not get it from align."""
    cfg = cfg_with()
    upd = minimal_updates(cfg, recipe_to_config_updates(Recipe.preset("bf16")))
    assert not any("pow2_" in k for k in upd), upd


def test_minimal_updates_skip_what_already_holds():
    cfg = load_config(EXAMPLES / "qwen3_8b_base" / "jetrl.yaml")
    assert minimal_updates(cfg, recipe_to_config_updates(Recipe.preset("jetrl"))) == {}
    upd = minimal_updates(cfg, recipe_to_config_updates(Recipe.preset("jetrl_kv")))
    assert upd == {
        "policy.generation.vllm_cfg.kv_cache_dtype": "fp8",
        "jetrl.recipe": "jetrl_kv",
        "jetrl.onpolicy_kv": True,
    }


def test_merge_updates_replaces_null_sections():
    cfg = OmegaConf.create({"policy": {"megatron_cfg": {"env_vars": None}}})
    out = merge_updates(
        cfg, {"policy.megatron_cfg.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"}
    )
    assert out.policy.megatron_cfg.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES == "0"
    assert cfg.policy.megatron_cfg.env_vars is None  # input untouched


# --------------------------------------------------------------------------- shipped examples

EXPECTED = {
    "bf16": ("bf16", True),
    "fp8_rollout": ("fp8_rollout", False),
    "jetrl": ("jetrl", True),
    "jetrl_kv": ("jetrl_kv", True),
}
ALL_YAML = sorted(EXAMPLES.rglob("*.yaml"))


def test_every_model_has_every_recipe():
    for model in ("qwen3_8b_base", "llama3.1_8b_instruct", "qwen2.5_7b"):
        assert sorted(p.stem for p in (EXAMPLES / model).glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_shipped_yaml_loads_validates_and_has_its_verdict(path):
    """Every YAML under examples/configs validates without errors or warnings; its verdict is
    the one its recipe label (jetrl.recipe) promises; NeMo-RL's FP8 e2e one is off-policy for
    the FP32-formula reason only."""
    from nemo_jetrl.arch import generic_arch
    from nemo_jetrl.config import arch_from_config
    from nemo_jetrl.flow.check import check_on_policy

    cfg = load_config(path)
    issues = validate(cfg)
    assert errors(issues) == [], [str(i) for i in issues]
    assert not [i for i in issues if i.level == "warning"], [str(i) for i in issues]
    recipe = recipe_from_config(cfg)
    check = check_on_policy(arch_from_config(cfg) or generic_arch(4), recipe)
    if path.stem == "nemo_rl_fp8_e2e":
        assert recipe.train.scale_mode("activation") == "fp32"
        assert recipe.rollout.quantizer == "vllm"
        assert not check.on_policy and check.keys == ["jetrl.vllm_patch"]
        return
    label = OmegaConf.select(cfg, "jetrl.recipe", default=None)
    if path.parent.name == "models":
        label = "bf16"  # model fragments add no precision keys to the BF16 default
    assert label in EXPECTED, f"{path}: set jetrl.recipe so the test knows the verdict"
    name, on_policy = EXPECTED[label]
    assert recipe.name == name
    assert check.on_policy is on_policy
    if not on_policy:
        assert "policy.megatron_cfg.fp8_cfg.enabled" in check.keys


def test_kv_calibration_extra_keys_reach_the_recipe_and_the_settings():
    from nemo_jetrl.kvcache import CalibrationSettings

    kv = (
        "policy.generation.vllm_cfg.precision=fp8",
        "policy.generation.vllm_cfg.kv_cache_dtype=fp8",
    )
    cfg = cfg_with(
        *kv,
        "jetrl.kv_calibration.reduction=max",
        "jetrl.kv_calibration.percentile=100",
        "jetrl.kv_calibration.include_q=false",
        "jetrl.kv_calibration.micro_batch_size=8",
    )
    assert errors(validate(cfg)) == []
    cal = recipe_from_config(cfg).kv_calibration
    assert (cal.reduction, cal.include_q, cal.micro_batch_size) == ("max", False, 8)
    s = CalibrationSettings.from_recipe(cal)
    assert (s.reduction, s.include_q, s.micro_batch_size) == ("max", False, 8)
    # Unset (null) keys keep the derived / backend defaults.
    default = CalibrationSettings.from_recipe(recipe_from_config(cfg_with(*kv)).kv_calibration)
    assert (default.reduction, default.include_q, default.micro_batch_size) == (
        "percentile",
        CalibrationSettings.include_q,
        CalibrationSettings.micro_batch_size,
    )
    # The config written back from a recipe carries the keys (round trip).
    back = merge_updates(cfg_with(), recipe_to_config_updates(recipe_from_config(cfg)))
    assert recipe_from_config(back).kv_calibration == cal


def test_kv_calibration_extra_keys_are_validated_together():
    found = issue_paths(
        cfg_with(
            "jetrl.kv_calibration.reduction=mean",
            "jetrl.kv_calibration.include_q=yes",
            "jetrl.kv_calibration.micro_batch_size=0",
        )
    )
    base = "jetrl.kv_calibration"
    assert "got 'mean'; expected" in str(found[f"{base}.reduction"][0])
    assert found[f"{base}.reduction"][0].allowed == ("max", "percentile", None)
    assert "true or false" in str(found[f"{base}.include_q"][0])
    assert "integer > 0" in str(found[f"{base}.micro_batch_size"][0])
    for bad in ("-3", "2.5", "true"):
        got = issue_paths(cfg_with(f"{base}.micro_batch_size={bad}"))
        assert f"{base}.micro_batch_size" in got, bad
    with pytest.raises(ConfigError, match="3 problems in config"):
        recipe_from_config(
            cfg_with(
                f"{base}.reduction=mean", f"{base}.include_q=yes", f"{base}.micro_batch_size=0"
            )
        )


def test_kv_calibration_percentile_ignored_under_max_is_a_warning():
    issues = validate(
        cfg_with("jetrl.kv_calibration.reduction=max", "jetrl.kv_calibration.percentile=99.0")
    )
    assert errors(issues) == []
    (issue,) = [i for i in issues if i.path == "jetrl.kv_calibration.percentile"]
    assert issue.level == "warning" and "ignored" in str(issue)


def test_val_period_minus_one_is_nemo_rl_never():
    """NeMo-RL's own configs write grpo.val_period: -1 (validates only when > 0)."""
    from nemo_jetrl.config.run_keys import read_run_keys

    assert "grpo.val_period" not in issue_paths(cfg_with("grpo.val_period=-1"))
    issues: list = []
    assert read_run_keys(cfg_with("grpo.val_period=-1"), issues)["val_period"] == 0 and not issues
    assert "grpo.val_period" in issue_paths(cfg_with("grpo.val_period=-2"))
