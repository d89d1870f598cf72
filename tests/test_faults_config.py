"""Fault injection, config side (issue 17, items 3, 5, 6): bad input a new user types, each kept
as a regression test. Every case goes through the console script (`nemo_jetrl.cli.main`) the
way a user runs it and must end with exit 2, a message naming the key, no traceback, and for
`train` before any work starts (no run directory created). The refit side is in
tests/test_faults_refit.py; run directories and checkpoints have their own module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_jetrl.cli import main

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "examples" / "configs" / "local"


@pytest.fixture(autouse=True)
def _clean_te_scale_env(monkeypatch):
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)


def _model_json(path: Path, **keys) -> Path:
    """A Llama config.json with the local backend's defaults, ``keys`` changed."""
    base = json.loads((REPO / "nemo_jetrl/backends/local/assets/model_config.json").read_text())
    base.update(keys)
    path.write_text(json.dumps({k: v for k, v in base.items() if v is not None}))
    return path


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _train(capsys, tmp_path, config, *overrides):
    log_dir = tmp_path / "run"
    code, out, err = _cli(
        capsys, "train", config, f"logger.log_dir={log_dir}", *overrides,
        "--backend", "local", "--no-progress",
    )  # fmt: skip
    assert not log_dir.exists(), "a refused config must not start any work"
    return code, out, err


BAD_OVERRIDES = [
    ("policy.optimizer.kwargs.lr=-1", "policy.optimizer.kwargs.lr: got -1"),
    ("policy.optimizer.kwargs.lr=.inf", "policy.optimizer.kwargs.lr: got inf; expected a finite"),
    ("policy.optimizer.kwargs.eps=.nan", "policy.optimizer.kwargs.eps: got nan"),
    ("grpo.num_prompts_per_step=10000000000000000000000", "grpo.num_prompts_per_step: got 1"),
    ("grpo.num_prompts_per_step=1048576", "responses per step exceeds 1048576"),
    ("jetrl.local.num_threads=1000000000", "jetrl.local.num_threads: got 1000000000"),
    ("policy.generation.temperature=.inf", "policy.generation.temperature: got inf"),
    # issue 26: the loss keys once accepted .inf where lr was refused (one typed rule now)
    (
        "loss_fn.reference_policy_kl_penalty=.inf",
        "loss_fn.reference_policy_kl_penalty: got inf; expected a finite number",
    ),
    (
        "policy.generation.vllm_cfg=[1,2]",
        "policy.generation.vllm_cfg: got [1, 2]; expected a mapping",
    ),
    ("grpo.seed=${nope.x}", "grpo.seed: cannot resolve '${nope.x}'"),
    ("jetrl.local.cache_dir=${oc.env:JETRL_SURELY_UNSET_VAR}", "JETRL_SURELY_UNSET_VAR"),
    # derived seeds (seed + offsets) once overflowed torch's generator after the warm start began
    ("grpo.seed=9223372036854775808", "grpo.seed: got 9223372036854775808"),
]


@pytest.mark.parametrize(("override", "fragment"), BAD_OVERRIDES)
def test_check_and_train_refuse_the_same_bad_value(capsys, tmp_path, override, fragment):
    code, _, err = _cli(capsys, "check", LOCAL / "jetrl.yaml", override)
    assert code == 2 and fragment in err, err
    assert f"(set by override {override!r})" in err  # the message names where it came from
    code, _, err = _train(capsys, tmp_path, LOCAL / "jetrl.yaml", override)
    assert code == 2 and fragment in err, err


def test_unaligned_local_model_is_refused_not_silently_bf16(capsys, tmp_path):
    """Item 3: hidden 200 / MLP 324 has no linear TE's FP8 GEMM takes (in % 16, out % 8; partial
    128-blocks alone would be fine); the jetrl recipe must say so (it trained all-BF16 under
    the jetrl label), and check must look at that model."""
    model = _model_json(tmp_path / "m200.json", hidden_size=200, intermediate_size=324,
                        num_attention_heads=5, num_key_value_heads=1, head_dim=40)  # fmt: skip
    key = f"jetrl.local.model_config={model}"
    code, _, err = _cli(capsys, "check", LOCAL / "jetrl.yaml", key)
    assert code == 2
    assert "policy.megatron_cfg.fp8_cfg.enabled: promises FP8 but no linear" in err
    assert "policy.generation.vllm_cfg.precision: promises FP8" in err
    assert "q_proj 200x200" in err and "gate_proj 324x200" in err
    code, _, err = _cli(capsys, "check", LOCAL / "jetrl.yaml", key, "+jetrl.unaligned_layers=bf16")
    assert code == 2 and "jetrl.unaligned_layers=bf16 does not help" in err
    code, _, err = _train(capsys, tmp_path, LOCAL / "jetrl.yaml", key)
    assert code == 2 and "promises FP8 but no linear" in err
    # The BF16 recipe on that model is fine, and check reports the configured model's shapes.
    code, out, _ = _cli(capsys, "check", LOCAL / "bf16.yaml", key)
    assert code == 0 and "hidden 200, intermediate 324" in out


def test_check_uses_the_local_model_not_a_generic_one(capsys):
    code, out, _ = _cli(capsys, "check", LOCAL / "jetrl.yaml")
    assert code == 0
    assert "(2 layers, hidden 256, intermediate 512, heads 4/2; dense)" in out
    assert "generic" not in out


def test_partly_unaligned_model_names_the_layers_and_the_knob(capsys, tmp_path):
    model = _model_json(tmp_path / "m.json", intermediate_size=324)  # MLP unfit only (324 % 8)
    code, _, err = _cli(capsys, "check", LOCAL / "jetrl.yaml", f"jetrl.local.model_config={model}")
    assert code == 2 and "gate_proj 324x256" in err and "jetrl.unaligned_layers=bf16" in err
    # 320 = 2*128 + 64: partial blocks, FP8 on both sides (issue 39)
    model = _model_json(tmp_path / "m320.json", intermediate_size=320)
    code, out, err = _cli(
        capsys, "check", LOCAL / "jetrl.yaml", f"jetrl.local.model_config={model}"
    )
    assert code == 0, err + out


def test_model_config_head_dim(capsys, tmp_path):
    odd = _model_json(tmp_path / "hd25.json", hidden_size=200, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=None)  # fmt: skip
    code, _, err = _cli(capsys, "check", LOCAL / "bf16.yaml", f"jetrl.local.model_config={odd}")
    assert code == 2 and "jetrl.local.model_config" in err and "head_dim 25 is odd" in err
    ragged = _model_json(tmp_path / "hd.json", hidden_size=250, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=None)  # fmt: skip
    code, _, err = _cli(capsys, "check", LOCAL / "bf16.yaml", f"jetrl.local.model_config={ragged}")
    assert code == 2 and "hidden_size 250 is not divisible by num_attention_heads 4" in err


def test_non_utf8_inputs(capsys, tmp_path):
    cfg = tmp_path / "latin1.yaml"
    cfg.write_bytes(
        f"defaults: {LOCAL / 'bf16.yaml'}\ngrpo:\n  seed: 1 # caf\xe9\n".encode("latin-1")
    )
    code, _, err = _cli(capsys, "check", cfg)
    assert code == 2 and "not UTF-8 text (byte 0xe9" in err
    code, _, err = _train(capsys, tmp_path, cfg)
    assert code == 2 and "not UTF-8 text" in err
    model = tmp_path / "model.json"
    model.write_bytes(b'{"model_type": "llama", "x": "\xff"}')
    tok = tmp_path / "tok.json"
    tok.write_bytes(b'{"model": "\xff"}')
    code, _, err = _cli(
        capsys, "check", LOCAL / "bf16.yaml",
        f"jetrl.local.model_config={model}", f"jetrl.local.tokenizer={tok}",
    )  # fmt: skip
    assert code == 2 and "2 problems" in err
    assert "jetrl.local.model_config: model config" in err and "jetrl.local.tokenizer:" in err


def test_empty_file_is_an_error_not_a_default_config(capsys, tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    code, _, err = _cli(capsys, "check", empty)
    assert code == 2 and "the file is empty" in err
    code, _, err = _train(capsys, tmp_path, empty)
    assert code == 2 and "the file is empty" in err


def test_a_file_that_describes_no_run_is_an_error(capsys, tmp_path):
    """``foo: 1`` once checked a generic model (exit 0) and trained 10 default steps."""
    stray = tmp_path / "stray.yaml"
    stray.write_text("foo: 1\n")
    for cmd in ("check", "train"):
        code, _, err = (
            _cli(capsys, cmd, stray) if cmd == "check" else _train(capsys, tmp_path, stray)
        )
        assert code == 2 and "none of its keys (foo) is a section of a GRPO run" in err, err


def test_train_needs_a_model_check_may_ask_what_if(capsys, tmp_path):
    """A recipe fragment alone: `check` gives its verdict on generic layers; `train` needs to
    know what to train."""
    fragment = REPO / "examples" / "configs" / "recipes" / "jetrl.yaml"
    code, out, _ = _cli(capsys, "check", fragment)
    assert code == 0 and "generic aligned" in out
    code, _, err = _train(capsys, tmp_path, fragment)
    assert code == 2 and "policy.model_name: missing; a run names its model here" in err, err


def test_an_interpolation_in_a_key_name_is_an_error(capsys, tmp_path):
    cfg = tmp_path / "key.yaml"
    cfg.write_text(f"defaults: {LOCAL / 'bf16.yaml'}\ngrpo:\n  ${{nope.key}}: 3\n")
    code, _, err = _cli(capsys, "check", cfg)
    assert code == 2 and "grpo.${nope.key}: a key name cannot hold an interpolation" in err, err
    code, _, err = _train(capsys, tmp_path, LOCAL / "bf16.yaml", "+grpo.${nope.x}=3")
    assert code == 2 and "override '+grpo.${nope.x}=3': a key name cannot hold" in err, err


def test_bad_override_does_not_hide_the_files_own_errors(capsys, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"defaults: {LOCAL / 'bf16.yaml'}\npolicy:\n  optimizer:\n    kwargs:\n"
                   "      lr: -1\n")  # fmt: skip
    code, _, err = _cli(capsys, "check", cfg, "grpo.nokey=1")
    assert code == 2 and "2 problems" in err
    assert "grpo.nokey: override 'grpo.nokey=1': key not in config" in err
    assert "policy.optimizer.kwargs.lr: got -1" in err


def test_run_directories_under_a_regular_file(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for key in ("logger.log_dir", "checkpointing.checkpoint_dir", "jetrl.local.cache_dir"):
        code, _, err = _cli(capsys, "check", LOCAL / "bf16.yaml", f"{key}={afile}/sub")
        assert code == 2 and f"{key}: {afile}/sub lies under {afile}, which is a regular" in err
    code, _, err = _cli(
        capsys, "train", LOCAL / "bf16.yaml", f"checkpointing.checkpoint_dir={afile}/ck",
        f"logger.log_dir={tmp_path / 'run'}", "--backend", "local", "--no-progress",
    )  # fmt: skip
    assert code == 2 and "checkpointing.checkpoint_dir" in err and not (tmp_path / "run").exists()


def test_unwritable_log_dir_is_a_warning_for_check_and_an_error_for_train(
    capsys, tmp_path, monkeypatch
):
    import nemo_jetrl.config.run_keys as run_keys

    # Stand-in for a read-only directory (the tests may run as root, which can write anywhere).
    monkeypatch.setattr(run_keys.os, "access", lambda p, mode: Path(p) != tmp_path)
    target = f"logger.log_dir={tmp_path / 'run'}"
    code, out, _ = _cli(capsys, "check", LOCAL / "bf16.yaml", target)
    assert code == 0 and f"warning: logger.log_dir: {tmp_path} is not writable" in out
    code, _, err = _train(capsys, tmp_path, LOCAL / "bf16.yaml")
    assert code == 2 and f"logger.log_dir: {tmp_path} is not writable" in err


def test_megatron_optimizer_keys_are_checked_too(capsys):
    cfg = REPO / "examples" / "configs" / "qwen3_8b_base" / "jetrl_kv.yaml"
    code, _, err = _cli(capsys, "check", cfg, "++policy.megatron_cfg.optimizer.lr=.inf")
    assert code == 2 and "policy.megatron_cfg.optimizer.lr: got inf" in err
