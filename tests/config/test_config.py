"""Config validation: every rule names its key, errors are reported together, warnings and notes
(loading: test_config_loading.py; recipe mapping and shipped examples: test_config_recipes.py)."""

from __future__ import annotations

import sys

import pytest
from config_files import (
    EXAMPLES,
    cfg_with,
    clean_te_scale_env,  # noqa: F401 (autouse, for this module)
    issue_paths,
    write,
)

from nemo_jetrl.config import (
    ConfigError,
    ConfigIssue,
    errors,
    load_config,
    recipe_from_config,
    validate,
)


def test_base_config_is_valid_and_bf16():
    cfg = cfg_with()
    assert errors(validate(cfg)) == []
    assert recipe_from_config(cfg).name == "bf16"


@pytest.mark.parametrize(
    ("overrides", "path", "needle"),
    [
        (["+jetrl.vlm_patch=true"], "jetrl.vlm_patch", "did you mean jetrl.vllm_patch"),
        (["jetrl.vllm_patch=yes"], "jetrl.vllm_patch", "got 'yes'; expected true or false"),
        (["jetrl.recipe=fast"], "jetrl.recipe", "got 'fast'; expected one of"),
        (["jetrl.unaligned_layers=skip"], "jetrl.unaligned_layers", "got 'skip'; expected"),
        (
            ["jetrl.train_num_first_layers_in_bf16=-1"],
            "jetrl.train_num_first_layers_in_bf16",
            ">= 0",
        ),
        (
            ["+jetrl.kv_calibration.percentil=99"],
            "jetrl.kv_calibration.percentil",
            "did you mean jetrl.kv_calibration.percentile",
        ),
        (["jetrl.kv_calibration.data_fraction=0"], "jetrl.kv_calibration.data_fraction", "(0, 1]"),
        (["jetrl.kv_calibration.percentile=101"], "jetrl.kv_calibration.percentile", "(0, 100]"),
        (["jetrl.kv_calibration.margin=0.5"], "jetrl.kv_calibration.margin", ">= 1"),
        (["jetrl.kv_calibration.mask=padding"], "jetrl.kv_calibration.mask", "got 'padding'"),
        (["jetrl.onpolicy_kv=true"], "jetrl.onpolicy_kv", "needs an FP8 KV cache"),
        (
            ["policy.generation.vllm_cfg.kv_cache_dtype=fp8"],
            "policy.generation.vllm_cfg.kv_cache_dtype",
            "needs policy.generation.vllm_cfg.precision=fp8",
        ),
        (
            ["policy.generation.vllm_cfg.kv_cache_dtype=int8"],
            "policy.generation.vllm_cfg.kv_cache_dtype",
            "got 'int8'; expected",
        ),
        (
            ["policy.generation.vllm_cfg.precision=fp4"],
            "policy.generation.vllm_cfg.precision",
            "got 'fp4'; expected",
        ),
        (
            ["policy.megatron_cfg.fp8_cfg.enabled=true", "policy.megatron_cfg.fp8_cfg.fp8=e5m2"],
            "policy.megatron_cfg.fp8_cfg.fp8",
            "got 'e5m2'; expected",
        ),
        (
            ["policy.megatron_cfg.fp8_cfg.enabled=true", "~policy.megatron_cfg.fp8_cfg.fp8_recipe"],
            "policy.megatron_cfg.fp8_cfg.fp8_recipe",
            "required when fp8_cfg.enabled",
        ),
        (
            ["policy.megatron_cfg.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES=yes"],
            "policy.megatron_cfg.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES",
            "got 'yes'; expected",
        ),
        (
            ["policy.generation.vllm_cfg.num_first_layers_in_bf16=-2"],
            "policy.generation.vllm_cfg.num_first_layers_in_bf16",
            "integer >= 0",
        ),
        (
            [
                "policy.generation.vllm_cfg.num_first_layers_in_bf16=20",
                "policy.generation.vllm_cfg.num_last_layers_in_bf16=20",
            ],
            "policy.generation.vllm_cfg.num_first_layers_in_bf16",
            "exceed the model's 32 layers",
        ),
        (
            [
                "policy.megatron_cfg.fp8_cfg.enabled=true",
                "jetrl.train_num_first_layers_in_bf16=16",
                "jetrl.train_num_last_layers_in_bf16=16",
            ],
            "jetrl.train_num_first_layers_in_bf16",
            "no layer would run in FP8",
        ),
        (
            [
                "policy.megatron_cfg.fp8_cfg.enabled=true",
                "policy.megatron_cfg.pipeline_model_parallel_size=4",
                "jetrl.train_num_last_layers_in_bf16=9",
            ],
            "jetrl.train_num_last_layers_in_bf16",
            "layers of a pipeline stage",
        ),
        (
            [
                "loss_fn.truncated_importance_sampling_type=tis",
                "loss_fn.truncated_importance_sampling_ratio=2.0",
            ],
            "loss_fn.truncated_importance_sampling_type",
            "use_importance_sampling_correction=true",
        ),
        (
            [
                "loss_fn.use_importance_sampling_correction=true",
                "loss_fn.truncated_importance_sampling_type=icepop",
                "loss_fn.truncated_importance_sampling_ratio=5.0",
            ],
            "loss_fn.truncated_importance_sampling_ratio_min",
            "set a lower bound",
        ),
        (
            [
                "loss_fn.use_importance_sampling_correction=true",
                "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
                "loss_fn.truncated_importance_sampling_ratio=5.0",
            ],
            "loss_fn.truncated_importance_sampling_ratio_min",
            "set a lower bound",
        ),
        (
            [
                "loss_fn.use_importance_sampling_correction=true",
                "loss_fn.truncated_importance_sampling_type=tis",
            ],
            "loss_fn.truncated_importance_sampling_ratio",
            "must be a positive number",
        ),
        (
            [
                "loss_fn.use_importance_sampling_correction=true",
                "loss_fn.truncated_importance_sampling_type=tis",
                "loss_fn.truncated_importance_sampling_ratio=-1",
            ],
            "loss_fn.truncated_importance_sampling_ratio",
            "must be a positive number",
        ),
        (
            [
                "loss_fn.use_importance_sampling_correction=true",
                "loss_fn.truncated_importance_sampling_type=tis",
                "loss_fn.truncated_importance_sampling_ratio=2.0",
                "loss_fn.truncated_importance_sampling_ratio_min=3.0",
            ],
            "loss_fn.truncated_importance_sampling_ratio_min",
            "must be <=",
        ),
        (
            [
                "loss_fn.use_importance_sampling_correction=true",
                "loss_fn.truncated_importance_sampling_type=clip",
                "loss_fn.truncated_importance_sampling_ratio=2.0",
            ],
            "loss_fn.truncated_importance_sampling_type",
            "unknown value 'clip'",
        ),
        (
            [
                "loss_fn.use_importance_sampling_correction=true",
                "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
                "loss_fn.truncated_importance_sampling_ratio=2.0",
                "loss_fn.truncated_importance_sampling_ratio_min=0.5",
                "loss_fn.sequence_level_importance_ratios=true",
            ],
            "loss_fn.sequence_level_importance_ratios",
            "seq-mask-tis",
        ),
        (
            [
                "jetrl.vllm_patch=true",
                "policy.generation.vllm_cfg.precision=fp8",
                "+policy.generation.vllm_cfg.is_mx=true",
            ],
            "jetrl.vllm_patch",
            "blockwise FP8 only",
        ),
    ],
)
def test_validation_rules(overrides, path, needle):
    found = issue_paths(cfg_with(*overrides))
    assert path in found, f"no error at {path}; got {sorted(found)}"
    assert any(needle in str(i) for i in found[path]), [str(i) for i in found[path]]


def test_valid_is_correction_settings_pass():
    cfg = cfg_with(
        "loss_fn.use_importance_sampling_correction=true",
        "loss_fn.truncated_importance_sampling_type=icepop",
        "loss_fn.truncated_importance_sampling_ratio=5.0",
        "loss_fn.truncated_importance_sampling_ratio_min=0.5",
    )
    assert errors(validate(cfg)) == []


def test_allowed_values_are_listed():
    (issue,) = issue_paths(
        cfg_with(
            "policy.megatron_cfg.fp8_cfg.enabled=true",
            "policy.megatron_cfg.fp8_cfg.fp8_recipe=perrow",
        )
    )["policy.megatron_cfg.fp8_cfg.fp8_recipe"]
    assert issue.allowed == ("blockwise", "mxfp8", "tensorwise", "delayed")
    assert "(allowed: blockwise, mxfp8, tensorwise, delayed)" in str(issue)


def test_all_errors_are_reported_together():
    cfg = cfg_with(
        "+jetrl.foo=1",
        "policy.generation.vllm_cfg.kv_cache_dtype=fp8",
        "loss_fn.truncated_importance_sampling_type=icepop",
        "jetrl.kv_calibration.margin=0.1",
    )
    with pytest.raises(ConfigError) as exc:
        recipe_from_config(cfg)
    msg = str(exc.value)
    for needle in (
        "jetrl.foo: unknown key",
        "policy.generation.vllm_cfg.kv_cache_dtype:",
        "loss_fn.truncated_importance_sampling_type:",
        "loss_fn.truncated_importance_sampling_ratio:",
        "loss_fn.truncated_importance_sampling_ratio_min:",
        "jetrl.kv_calibration.margin:",
    ):
        assert needle in msg
    assert msg.startswith("6 problems in config")


def test_unaligned_model_is_rejected_unless_bf16_fallback(tmp_path):
    # 688 = 5*128 + 48: partial 128-blocks, which blockwise FP8 runs (issue 39)
    partial = write(
        tmp_path / "partial" / "config.json",
        '{"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, '
        '"num_hidden_layers": 4, "num_attention_heads": 2, "vocab_size": 1000}',
    )
    fp8 = "policy.megatron_cfg.fp8_cfg.enabled=true"
    assert errors(validate(cfg_with(f"+jetrl.model_config={partial}", fp8))) == []
    # 684 is not a multiple of 8 (TE's FP8 GEMM rule): refused
    cfgjson = write(
        tmp_path / "tiny" / "config.json",
        '{"model_type": "llama", "hidden_size": 256, "intermediate_size": 684, '
        '"num_hidden_layers": 4, "num_attention_heads": 2, "vocab_size": 1000}',
    )
    ov = [f"+jetrl.model_config={cfgjson}", fp8]
    found = issue_paths(cfg_with(*ov))
    (issue,) = found["policy.megatron_cfg.fp8_cfg.enabled"]
    assert "out_features=684 is not a multiple of 8" in issue.message
    assert "gate_proj" in issue.message
    # NeMo-RL reads no jetrl.unaligned_layers: the fix named is align or the per-name words
    assert "jetrl.unaligned_layers=bf16" not in issue.message and "`jetrl align`" in issue.message
    assert (
        "add ['gate_proj', 'up_proj', 'down_proj'] to both policy.generation.vllm_cfg."
        in issue.message
    )
    assert "and jetrl.train_bf16_layer_kws" in issue.message
    words, IGNORED = (
        "[gate_proj,up_proj,down_proj]",
        "policy.generation.vllm_cfg.quantization_ignored_layer_kws",
    )
    both = [f"+{k}={words}" for k in ("jetrl.train_bf16_layer_kws", IGNORED)]
    assert errors(validate(cfg_with(*ov, *both))) == []
    assert errors(validate(cfg_with(*ov, "jetrl.unaligned_layers=bf16"))) == []
    # the same model in BF16 has nothing to complain about
    assert errors(validate(cfg_with(f"+jetrl.model_config={cfgjson}"))) == []


def test_bad_model_config_path_is_an_error():
    found = issue_paths(cfg_with("+jetrl.model_config=/nonexistent/config.json"))
    assert "not found" in found["jetrl.model_config"][0].message


def test_unknown_model_is_a_note_not_an_error():
    issues = validate(cfg_with("policy.model_name=org/private-model"))
    assert errors(issues) == []
    assert any(i.level == "note" and i.path == "policy.model_name" for i in issues)


def test_interpolation_errors_are_reported():
    found = issue_paths(cfg_with("policy.generation.vllm_cfg.precision=${policy.nope}"))
    assert "cannot resolve" in found["policy.generation.vllm_cfg.precision"][0].message


def test_jetrl_local_is_validated_by_the_section_the_caller_gives():
    from nemo_jetrl.config import BackendSection

    def validate_local_config(section, path):
        bad = [k for k in section if k not in ("model", "steps")]
        return [ConfigIssue(f"{path}.{k}", "unknown key", ("model", "steps")) for k in bad]

    section = BackendSection(
        validate=validate_local_config,
        validate_run=lambda cfg: [ConfigIssue("policy.optimizer.name", "only adamw here")],
        model_config=lambda section: None,
    )
    cfg = cfg_with("+jetrl.local={model: tiny, steps: 3, colour: red}")
    found = [i.path for i in errors(validate(cfg, {"local": lambda: section}))]
    assert found == ["jetrl.local.colour", "policy.optimizer.name"]


def test_jetrl_local_without_a_section_is_noted_and_the_backend_not_imported(monkeypatch):
    # config/ never imports a backend: without a provider the section is only noted.
    monkeypatch.setitem(sys.modules, "nemo_jetrl.backends.local.config", None)
    issues = validate(cfg_with("+jetrl.local={anything: 1}"))
    assert errors(issues) == []
    assert any(i.path == "jetrl.local" and i.level == "note" for i in issues)
    assert errors(validate(cfg_with("+jetrl.local=3")))[0].path == "jetrl.local"


def test_the_pipeline_gives_the_local_section():
    from nemo_jetrl.config import load_valid_config
    from nemo_jetrl.flow.pipeline import BACKEND_SECTIONS

    cfg = cfg_with("+jetrl.local={colour: red}")
    with pytest.raises(ConfigError) as exc:
        load_valid_config(cfg, sections=BACKEND_SECTIONS)
    assert "jetrl.local.colour" in [i.path for i in exc.value.issues]


def test_recipe_label_disagreeing_with_keys_is_a_warning():
    issues = validate(
        load_config(EXAMPLES / "qwen3_8b_base" / "jetrl.yaml", ["jetrl.vllm_patch=false"])
    )
    (w,) = [i for i in issues if i.path == "jetrl.recipe"]
    assert w.level == "warning" and "rollout.quantizer" in w.message


def test_launch_environment_disagreeing_with_the_config_is_a_warning(monkeypatch):
    ov = ("policy.megatron_cfg.fp8_cfg.enabled=true", "jetrl.recipe=null")
    key = "policy.megatron_cfg.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    (w,) = [i for i in validate(cfg_with(*ov)) if i.level == "warning"]
    assert w.path == key and "current environment" in w.message
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0")
    assert not [i for i in validate(cfg_with(*ov)) if i.level == "warning"]
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES")
    assert not [i for i in validate(cfg_with(*ov)) if i.level == "warning"]


def test_megatron_generation_backend_samples_with_the_training_model():
    cfg = cfg_with(
        "policy.generation.backend=megatron",
        "policy.megatron_cfg.fp8_cfg.enabled=true",
        "policy.generation.vllm_cfg.precision=fp8",
    )
    issues = validate(cfg)
    assert any(i.level == "note" and "backend=megatron" in i.message for i in issues)
    r = recipe_from_config(cfg)
    assert r.rollout.fp8_linears and r.rollout.quantizer == "te"
    assert r.rollout.scale_mode("weight") == r.train.scale_mode("weight")


def test_other_generation_backends_get_a_warning():
    issues = validate(cfg_with("policy.generation.backend=sglang"))
    (w,) = [i for i in issues if i.path == "policy.generation.backend"]
    assert w.level == "warning" and w.allowed == ("vllm", "megatron")


def test_arch_from_config():
    from nemo_jetrl.config import arch_from_config

    assert arch_from_config(cfg_with()).name == "meta-llama/Llama-3.1-8B-Instruct"
    assert arch_from_config(cfg_with("policy.model_name=org/x")) is None
    with pytest.raises(ConfigError, match="model config not found"):
        arch_from_config(cfg_with("+jetrl.model_config=/nope/config.json"))
