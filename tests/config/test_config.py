"""Config loading (defaults: inheritance, overrides), validation, Recipe mapping, examples."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_jetrl.config import (
    ConfigError,
    ConfigIssue,
    apply_overrides,
    errors,
    load_config,
    merge_updates,
    minimal_updates,
    parse_override,
    recipe_from_config,
    recipe_to_config_updates,
    validate,
)
from nemo_jetrl.recipe import PRESET_NAMES, Recipe, preset_differences

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "configs"
BASE = EXAMPLES / "base" / "grpo_megatron.yaml"


@pytest.fixture(autouse=True)
def _clean_te_scale_env(monkeypatch):
    """Validation warns when the process environment sets TE's scale rule; other tests in the
    same process may have set it (nemo_jetrl.megatron does, on purpose)."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def cfg_with(*overrides: str):
    return load_config(BASE, list(overrides))


def issue_paths(cfg) -> dict[str, list[ConfigIssue]]:
    out: dict[str, list[ConfigIssue]] = {}
    for i in errors(validate(cfg)):
        out.setdefault(i.path, []).append(i)
    return out


# ------------------------------------------------------------------------------ inheritance


def test_defaults_chain_with_relative_paths(tmp_path):
    write(tmp_path / "a" / "grand.yaml", "x: 1\ny: {p: 1, q: 1}\nz: ${x}\n")
    write(tmp_path / "a" / "b" / "parent.yaml", "defaults: ../grand.yaml\ny: {q: 2}\n")
    child = write(tmp_path / "c" / "child.yaml", "defaults: ../a/b/parent.yaml\nx: 3\n")
    cfg = load_config(child)
    assert OmegaConf.to_container(cfg, resolve=True) == {"x": 3, "y": {"p": 1, "q": 2}, "z": 3}
    assert "defaults" not in cfg


def test_defaults_list_later_wins_and_absolute_paths(tmp_path):
    p1 = write(tmp_path / "p1.yaml", "k: 1\nonly1: true\n")
    write(tmp_path / "p2.yaml", "k: 2\n")
    child = write(tmp_path / "child.yaml", f"defaults:\n  - {p1}\n  - p2.yaml\n")
    cfg = load_config(child)
    assert cfg.k == 2 and cfg.only1 is True
    child2 = write(tmp_path / "child2.yaml", "defaults: [p1.yaml, p2.yaml]\nk: 9\n")
    assert load_config(child2).k == 9


def test_override_marker_replaces_a_section(tmp_path):
    write(tmp_path / "p.yaml", "s: {a: 1, b: 2}\n")
    child = write(tmp_path / "c.yaml", "defaults: p.yaml\ns: {_override_: true, c: 3}\n")
    assert OmegaConf.to_container(load_config(child)) == {"s": {"c": 3}}


def test_inheritance_errors(tmp_path):
    write(tmp_path / "a.yaml", "defaults: b.yaml\n")
    write(tmp_path / "b.yaml", "defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="inheritance cycle"):
        load_config(tmp_path / "a.yaml")
    write(tmp_path / "m.yaml", "defaults: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"missing\.yaml.*named in defaults: of"):
        load_config(tmp_path / "m.yaml")
    write(tmp_path / "bad.yaml", "a: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot parse YAML"):
        load_config(tmp_path / "bad.yaml")
    write(tmp_path / "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(tmp_path / "list.yaml")


def test_a_file_read_once_is_reused_until_its_bytes_change(tmp_path, monkeypatch):
    """The loader keeps each file's inherited config (a tree walk reads the same bases hundreds
    of times): a second child of the same parent parses only itself, every caller gets its own
    copy, and an edit of the same size (a time stamp may not move) or a new cycle is seen."""
    from nemo_jetrl.config import load

    parsed: list[str] = []
    real = load._parse_file
    monkeypatch.setattr(load, "_parse_file", lambda p, d=None: parsed.append(p.name) or real(p, d))
    write(tmp_path / "grand.yaml", "x: 1\ns: {a: 1}\n")
    write(tmp_path / "parent.yaml", "defaults: grand.yaml\ny: 2\n")
    one = write(tmp_path / "one.yaml", "defaults: parent.yaml\nz: 3\n")
    two = write(tmp_path / "two.yaml", "defaults: parent.yaml\ns: {_override_: true, b: 2}\n")
    first = load_config(one)
    assert parsed == ["one.yaml", "parent.yaml", "grand.yaml"]
    first.x, first.s.a = 99, 99  # the caller's copy: the next load must not see it
    parsed.clear()
    assert OmegaConf.to_container(load_config(two)) == {"x": 1, "s": {"b": 2}, "y": 2}
    assert OmegaConf.to_container(load_config(one)) == {"x": 1, "s": {"a": 1}, "y": 2, "z": 3}
    assert parsed == ["two.yaml"]  # the parent's chain came from the first load
    write(tmp_path / "grand.yaml", "x: 5\ns: {a: 1}\n")  # same size, maybe the same mtime
    assert load_config(one).x == 5
    write(tmp_path / "grand.yaml", "defaults: one.yaml\n")
    with pytest.raises(ConfigError, match="inheritance cycle"):
        load_config(two)


# -------------------------------------------------------------------------------- overrides


def test_parse_override():
    assert parse_override("a.b=1") == ("set", "a.b", 1)
    assert parse_override("+a.c='1'") == ("add", "a.c", "1")
    assert parse_override("++a.d=null") == ("force", "a.d", None)
    assert parse_override("a=[1, 2]") == ("set", "a", [1, 2])
    assert parse_override("a=e4m3") == ("set", "a", "e4m3")
    assert parse_override("~a.b")[:2] == ("delete", "a.b")
    with pytest.raises(ValueError, match="not key=value"):
        parse_override("novalue")


def test_overrides_apply_in_order(tmp_path):
    cfg = OmegaConf.create({"a": {"b": 1, "c": 2}, "p": "${a.b}"})
    apply_overrides(cfg, ["a.b=5", "+a.new=x", "++a.c=3", "++z.y=1", "~a.new"])
    assert OmegaConf.to_container(cfg, resolve=True) == {
        "a": {"b": 5, "c": 3},
        "p": 5,
        "z": {"y": 1},
    }


def test_bad_overrides_are_reported_together():
    cfg = OmegaConf.create({"jetrl": {"vllm_patch": False}, "a": 1})
    with pytest.raises(ConfigError) as exc:
        apply_overrides(cfg, ["jetrl.vllm_pach=true", "+a=2", "~nope", "garbage"])
    msg = str(exc.value)
    assert "4 problems" in msg
    assert "did you mean jetrl.vllm_patch" in msg
    assert "use +jetrl.vllm_pach" in msg
    assert "already set; use a=" in msg
    assert "cannot delete" in msg
    assert "not key=value" in msg


def test_load_config_applies_overrides():
    cfg = load_config(EXAMPLES / "qwen3_8b_base" / "jetrl.yaml", ["jetrl.vllm_patch=false"])
    assert cfg.jetrl.vllm_patch is False
    assert cfg.policy.model_name == "Qwen/Qwen3-8B-Base"


# ------------------------------------------------------------------------------- validation


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
