"""`jetrl check` and `jetrl align`: output, exit codes, no tracebacks for user errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nemo_jetrl.cli import main
from nemo_jetrl.config import load_config, recipe_from_config

REPO = Path(__file__).resolve().parents[2]
EX = REPO / "examples" / "configs"


@pytest.fixture(autouse=True)
def _clean_te_scale_env(monkeypatch):
    """Validation warns when the process environment sets TE's scale rule; other tests in the
    same process may have set it (nemo_jetrl.megatron does, on purpose)."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_check_on_policy_config(capsys):
    code, out, _ = run(capsys, "check", EX / "qwen3_8b_base" / "jetrl_kv.yaml")
    assert code == 0
    assert "model:  Qwen/Qwen3-8B-Base (36 layers" in out
    assert "recipe: jetrl_kv" in out
    assert "train   linears fp8 e4m3 blockwise, scales pow2, quantizer te" in out
    assert "rollout linears fp8 e4m3 blockwise, scales pow2, quantizer jetrl" in out
    assert "kv cache: fp8 e4m3 per-tensor, scales trainer_calibrated" in out
    assert "0-35    attn     FP8 e4m3 pow2 (te)" in out
    assert "verdict: ON-POLICY" in out
    assert "DIFFERS" not in out


def test_check_fp8_rollout_is_off_policy_with_keys(capsys):
    code, out, _ = run(capsys, "check", EX / "llama3.1_8b_instruct" / "fp8_rollout.yaml")
    assert code == 1
    assert "verdict: OFF-POLICY (1 mismatch)" in out
    assert "keys: policy.megatron_cfg.fp8_cfg.enabled, policy.generation.vllm_cfg.precision" in out
    assert "0-31    attn     BF16" in out and "DIFFERS" in out


def test_check_nemo_rl_fp8_e2e_is_off_policy(capsys):
    code, out, _ = run(capsys, "check", EX / "nemo_rl_fp8_e2e.yaml")
    assert code == 1
    assert "OFF-POLICY (2 mismatches)" in out
    assert "fix:  jetrl.vllm_patch=true" in out
    assert "RN(448/amax)" in out
    # the suggested fix works
    code, out, _ = run(capsys, "check", EX / "nemo_rl_fp8_e2e.yaml", "jetrl.vllm_patch=true")
    assert code == 0 and "scales fp32, quantizer jetrl" in out


def test_check_with_overrides_reports_kv_edge(capsys):
    code, out, _ = run(
        capsys, "check", EX / "qwen2.5_7b" / "jetrl_kv.yaml", "jetrl.onpolicy_kv=false", "--edges"
    )
    assert code == 1
    assert "kv k_cache, kv v_cache (layers 0-27, 56 edges)" in out
    assert "fix:  jetrl.onpolicy_kv=true" in out
    assert "model.layers.27.self_attn.attn:v_cache" in out  # --edges lists them


def test_check_backward_table(capsys):
    code, out, _ = run(capsys, "check", EX / "qwen3_8b_base" / "jetrl.yaml", "--backward")
    assert code == 0
    assert "wgrad.input" in out and "FP8 e4m3 128x1 pow2 [te]" in out


def test_check_invalid_config_lists_every_problem(capsys):
    code, out, err = run(
        capsys,
        "check",
        EX / "qwen3_8b_base" / "jetrl.yaml",
        "+jetrl.vllm_pach=true",
        "loss_fn.use_importance_sampling_correction=false",
        "loss_fn.truncated_importance_sampling_type=icepop",
        "policy.generation.vllm_cfg.kv_cache_dtype=fp8",
        "policy.generation.vllm_cfg.precision=bfloat16",
    )
    assert code == 2
    assert out == ""
    assert "jetrl check: error: invalid config" in err
    for needle in (
        "jetrl.vllm_pach: unknown key; did you mean jetrl.vllm_patch?",
        "loss_fn.truncated_importance_sampling_type:",
        "loss_fn.truncated_importance_sampling_ratio_min:",
        "policy.generation.vllm_cfg.kv_cache_dtype:",
    ):
        assert needle in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["check", "/nonexistent.yaml"], "- <file>: config file not found: /nonexistent.yaml"),
        (["check", "/"], "- <file>: a directory, not a config file: /"),  # was "defaults:"
        (["check", EX / "qwen3_8b_base" / "jetrl.yaml", "jetrl.nope=1"], "key not in config"),
        (
            ["check", EX / "qwen3_8b_base" / "jetrl.yaml", "+jetrl.model_config=/x/config.json"],
            "model config not found",
        ),
    ],
)
def test_user_errors_exit_2(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err


def test_align_nemo_rl_e2e_keeps_training_and_fixes_rollout(capsys, tmp_path):
    out_yaml = tmp_path / "aligned.yaml"
    code, out, _ = run(capsys, "align", EX / "nemo_rl_fp8_e2e.yaml", "-o", out_yaml)
    assert code == 0, out
    assert "jetrl.vllm_patch: False -> True" in out
    assert "verdict: ON-POLICY" in out
    r = recipe_from_config(load_config(out_yaml))
    # training unchanged (source of truth): FP32 scales; rollout follows through the patch
    assert r.train.scale_mode("weight") == r.train.scale_mode("activation") == "fp32"
    assert r.rollout.quantizer == "jetrl" and r.rollout.scale_mode("activation") == "fp32"
    code, _, _ = run(capsys, "check", out_yaml)
    assert code == 0


def test_align_bf16_training_turns_rollout_bf16(capsys, tmp_path):
    out_yaml = tmp_path / "a.yaml"
    code, out, _ = run(capsys, "align", EX / "qwen3_8b_base" / "fp8_rollout.yaml", "-o", out_yaml)
    assert code == 0
    assert "policy.generation.vllm_cfg.precision: 'fp8' -> 'bfloat16'" in out
    assert recipe_from_config(load_config(out_yaml)).name == "bf16"


def test_align_kv_options_and_presets(capsys, tmp_path):
    src = EX / "qwen3_8b_base" / "jetrl_kv.yaml"
    a = tmp_path / "kv.yaml"
    code, _, _ = run(capsys, "align", src, "jetrl.onpolicy_kv=false", "-o", a)
    assert code == 0 and recipe_from_config(load_config(a)).name == "jetrl_kv"
    b = tmp_path / "nokv.yaml"
    code, _, _ = run(capsys, "align", src, "jetrl.onpolicy_kv=false", "--kv", "bf16", "-o", b)
    assert code == 0 and recipe_from_config(load_config(b)).name == "jetrl"
    c = tmp_path / "preset.yaml"
    code, out, _ = run(
        capsys, "align", EX / "llama3.1_8b_instruct" / "bf16.yaml", "--recipe", "jetrl_kv", "-o", c
    )
    assert code == 0 and "recipe: jetrl_kv" in out
    # --kv beside --recipe: the preset says what the KV cache is; was silently ignored
    d = tmp_path / "both.yaml"
    code, _, err = run(capsys, "align", src, "--recipe", "jetrl", "--kv", "onpolicy", "-o", d)
    assert code == 2 and "--kv onpolicy with --recipe jetrl" in err and not d.exists()


def test_align_says_when_a_bf16_training_drops_the_fp8_kv_cache(capsys, tmp_path):
    """BF16 training with an FP8 KV cache (NeMo-RL's fp8-kvcache recipe): on-policy KV needs the
    trainer's FP8 forward, so the aligned recipe is bf16 and the KV cache goes BF16: said, with
    the preset that keeps it; with --kv bf16 (asked for) nothing to say."""
    src = EX / "qwen3_8b_base" / "jetrl_kv.yaml"
    bf16_train = ("policy.megatron_cfg.fp8_cfg.enabled=false",)
    a = tmp_path / "a.yaml"
    code, out, _ = run(capsys, "align", src, *bf16_train, "-o", a)
    assert code == 0 and recipe_from_config(load_config(a)).name == "bf16"
    assert "note: the input's FP8 KV cache goes BF16" in out and "--recipe jetrl_kv" in out
    b = tmp_path / "b.yaml"
    code, out, _ = run(capsys, "align", src, *bf16_train, "--kv", "bf16", "-o", b)
    assert code == 0 and "FP8 KV cache goes BF16" not in out


def test_align_refuses_to_overwrite(capsys, tmp_path):
    out_yaml = tmp_path / "x.yaml"
    out_yaml.write_text("keep: me\n")
    code, _, err = run(capsys, "align", EX / "qwen3_8b_base" / "jetrl.yaml", "-o", out_yaml)
    assert code == 2 and "--force" in err
    assert out_yaml.read_text() == "keep: me\n"


def test_console_exit_codes_in_a_subprocess(tmp_path):
    """The real entry point: 0 / 1 / 2 and no traceback for a user error."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: ../nowhere.yaml\n")
    script = "import sys; from nemo_jetrl.cli import main; sys.exit(main(sys.argv[1:]))"
    codes = {}
    for name, path in (
        ("on", EX / "qwen2.5_7b" / "jetrl.yaml"),
        ("off", EX / "qwen2.5_7b" / "fp8_rollout.yaml"),
        ("bad", bad),
    ):
        p = subprocess.run(
            [sys.executable, "-c", script, "check", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        codes[name] = p.returncode
        assert "Traceback" not in p.stderr
    assert codes == {"on": 0, "off": 1, "bad": 2}


def test_check_json_summary(capsys):
    import json

    code, out, _ = run(capsys, "check", EX / "nemo_rl_fp8_e2e.yaml", "--json")
    assert code == 1
    data = json.loads(out)
    assert data["on_policy"] is False and data["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert {tuple(m["keys"]) for m in data["mismatches"]} == {("jetrl.vllm_patch",)}
    assert data["recipe"]["train"]["pow2_weight_scales"] is False


def test_check_prints_is_correction(capsys):
    _, out, _ = run(
        capsys,
        "check",
        EX / "qwen3_8b_base" / "fp8_rollout.yaml",
        "loss_fn.truncated_importance_sampling_type=icepop",
        "loss_fn.truncated_importance_sampling_ratio=5.0",
        "loss_fn.truncated_importance_sampling_ratio_min=0.5",
    )
    assert "importance-sampling correction: on (icepop, weights in [0.5, 5.0])" in out


def test_align_as_child_inherits_the_input(capsys, tmp_path):
    out_yaml = tmp_path / "child.yaml"
    code, _, _ = run(
        capsys,
        "align",
        EX / "qwen3_8b_base" / "jetrl_kv.yaml",
        "jetrl.onpolicy_kv=false",
        "policy.generation.vllm_cfg.use_deep_gemm=true",
        "--as-child",
        "-o",
        out_yaml,
    )
    assert code == 0
    from omegaconf import OmegaConf

    raw = OmegaConf.load(out_yaml)
    assert Path(str(raw.defaults)).name == "jetrl_kv.yaml"
    assert OmegaConf.to_container(raw.jetrl) == {"onpolicy_kv": True}
    assert raw.policy.generation.vllm_cfg.use_deep_gemm is True
    assert "megatron_cfg" not in raw.policy  # only what the overrides and align changed
    r = recipe_from_config(load_config(out_yaml))
    assert r.name == "jetrl_kv" and r.rollout.use_deep_gemm
    code, _, err = run(
        capsys,
        "align",
        EX / "qwen3_8b_base" / "jetrl.yaml",
        "~jetrl.recipe",
        "--as-child",
        "-o",
        tmp_path / "d.yaml",
    )
    assert code == 2 and "cannot express the deletion" in err


def test_train_refuses_off_policy_on_every_backend(tmp_path, capsys):
    """The allow_off_policy gate is the pipeline's, so the local backend applies it too."""
    cfg = (
        Path(__file__).resolve().parents[2] / "examples" / "configs" / "local" / "fp8_rollout.yaml"
    )
    rc = main(["train", str(cfg), "jetrl.allow_off_policy=false", "--backend", "local"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "OFF-POLICY" in err and "jetrl.allow_off_policy=true" in err


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("policy.generation=[1,2]", "policy.generation: got [1, 2]; expected a mapping"),
        ("policy=3", "policy: got 3; expected a mapping"),
        ("grpo=x", "grpo: got 'x'; expected a mapping"),
        ("grpo=null", "grpo: got None; expected a mapping"),
        ("policy.megatron_cfg.fp8_cfg=true", "policy.megatron_cfg.fp8_cfg: got True; expected a"),
        ("loss_fn=[]", "loss_fn: got []; expected a mapping"),
        ("jetrl.kv_calibration=[1]", "jetrl.kv_calibration: got [1]; expected a mapping"),
        (
            "policy.generation.vllm_cfg.pow2_weight_scaling_factors='false'",
            "pow2_weight_scaling_factors: got 'false'; expected true or false",
        ),
        ("+grpo.async_grpo.enabled=yes", "grpo.async_grpo.enabled: got 'yes'; expected true"),
        ("+policy.router_replay=[1]", "policy.router_replay: got [1]; expected a mapping"),
    ],
)
def test_structurally_wrong_sections_exit_2_naming_the_key(capsys, override, fragment):
    """Issue 26 item 6: a section given as a list or scalar once reached a verdict."""
    code, out, err = run(capsys, "check", EX / "qwen3_8b_base" / "jetrl.yaml", override)
    assert code == 2, out + err
    assert out == "" and "verdict" not in err
    assert fragment in err, err
    assert "Traceback" not in err


def test_a_yaml_syntax_error_names_the_file(capsys, tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("grpo:\n  a: [1\n")
    code, _, err = run(capsys, "check", bad)
    assert code == 2 and "in run.yaml, line 2" in err and "<unicode string>" not in err, err


def test_json_reports_an_invalid_config_on_stdout_and_refuses_text_options(capsys):
    """Scripts read --json's stdout: an invalid config is JSON there too (exit 2 as without
    --json; it printed nothing); --edges / --backward, options of the text report, were silently
    ignored beside --json."""
    import json

    code, out, err = run(
        capsys, "check", "--json", EX / "qwen3_8b_base" / "jetrl.yaml", "jetrl.nope=1"
    )
    data = json.loads(out)
    assert code == 2 and data["valid"] is False and "key not in config" in err
    assert [p["key"] for p in data["problems"]] == ["jetrl.nope"]
    code, out, err = run(capsys, "check", "--json", "--edges", EX / "qwen3_8b_base" / "jetrl.yaml")
    assert code == 2 and out == "" and "--edges with --json" in err
