"""`jetrl check` reports what the local backend's door (`setup.resolve_run`) refuses on sequence
lengths (`nemo_jetrl.backends.local.seq_len`): the same issue, key and text, exit 2, with the
config's other errors; a cluster config's check never loads the local backend for it.

Before: ``jetrl check examples/configs/local/jetrl.yaml policy.generation.max_new_tokens=300``
exited 0 ("ON-POLICY") while ``jetrl train`` of the same config exited 2 (the check's
``validate_run`` hook got the typed `Settings`, which hold no max_new_tokens, seed or step
counts); a tokenizer file that does not load passed the check and failed only in ``train``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from local_configs import EXAMPLES, REPO

from nemo_jetrl.cli import main

TOO_LONG = "policy.generation.max_new_tokens=300"
# an error the validator finds outside jetrl.local and the run keys (bf16: precision bfloat16)
OTHER_ERROR = "policy.generation.vllm_cfg.kv_cache_dtype=fp8"


def _problems(err: str) -> dict[str, str]:
    """``{key: message}`` of the ``  - key: message`` lines a refusal prints."""
    lines = [ln[4:] for ln in err.splitlines() if ln.startswith("  - ")]
    return dict(ln.split(": ", 1) for ln in lines)


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    return code, err


def test_check_reports_what_train_refuses_with_the_other_errors(capsys, tmp_path):
    config = str(EXAMPLES / "bf16.yaml")
    code, err = _cli(capsys, "check", config, TOO_LONG, OTHER_ERROR)
    assert code == 2 and "2 problems" in err, err
    checked = _problems(err)
    assert "policy.generation.vllm_cfg.kv_cache_dtype" in checked  # reported together
    msg = checked["policy.generation.max_new_tokens"]
    assert msg.startswith(
        "the longest prompt (5 tokens: training 5, validation 5) + max_new_tokens 300 = 305 "
        "positions, past the model's max_position_embeddings 256"
    ), msg
    log_dir = tmp_path / "run"
    code, err = _cli(capsys, "train", config, TOO_LONG, OTHER_ERROR, f"logger.log_dir={log_dir}",
                     f"jetrl.local.cache_dir={tmp_path / 'cache'}", "--backend", "local",
                     "--no-progress")  # fmt: skip
    assert code == 2 and not log_dir.exists()
    assert _problems(err) == checked  # same keys, same text


def test_check_passes_what_train_runs(capsys):
    """At the bound (prompt 5 + 251 = the table's 256 positions) the check passes, as the run
    does (test_local_seq_len.test_the_bound_is_the_trainers_whole_sequence)."""
    code, err = _cli(capsys, "check", str(EXAMPLES / "jetrl.yaml"),
                     "policy.generation.max_new_tokens=251")  # fmt: skip
    assert code == 0, err


def test_check_names_a_tokenizer_that_does_not_load(capsys, tmp_path):
    """A tokenizers-shaped JSON (a "model" object) that the tokenizers library refuses: only
    `seq_len.measure` loads it, so the check names it now, as ``train`` did."""
    bad = tmp_path / "tok.json"
    bad.write_text(json.dumps({"model": {"type": "nope"}}))
    code, err = _cli(capsys, "check", str(EXAMPLES / "jetrl.yaml"), f"jetrl.local.tokenizer={bad}")
    assert code == 2
    assert _problems(err)["jetrl.local.tokenizer"].startswith("cannot be loaded: "), err


def test_a_model_config_that_does_not_load_is_named_once(capsys, tmp_path):
    """The architecture check reads jetrl.local.model_config and says why it cannot; the lengths'
    own "cannot be loaded" is not repeated at the same key."""
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "max_position_embeddings": ')
    code, err = _cli(capsys, "check", str(EXAMPLES / "jetrl.yaml"),
                     f"jetrl.local.model_config={bad}")  # fmt: skip
    assert code == 2 and "1 problem" in err, err
    assert "is not valid JSON" in _problems(err)["jetrl.local.model_config"]


def test_a_cluster_config_check_loads_no_local_backend():
    """The section hooks are loaded only for a config with ``jetrl.local`` (config/sections.py):
    checking a NeMo-RL config imports neither the local backend's setup, config or lengths nor
    transformers (the lengths load a tokenizer)."""
    code = (
        "import sys\n"
        "from nemo_jetrl.cli import main\n"
        f"rc = main(['check', {str(REPO / 'examples/configs/qwen3_8b_base/jetrl.yaml')!r}])\n"
        "mods = [m for m in ('nemo_jetrl.backends.local.setup', 'nemo_jetrl.backends.local.config',"
        " 'nemo_jetrl.backends.local.seq_len', 'transformers') if m in sys.modules]\n"
        "print('RESULT', rc, mods)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=300, check=False)  # fmt: skip
    assert "RESULT 0 []" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]


def test_the_hook_gets_the_typed_run_keys_only_when_they_parse():
    """config/ hands the section hook the run keys typed (`read_run_keys`), never the tree; a run
    key's own problem is the validator's to name, and a hook reading every run key (no
    ``with_run_reads``) is not called then."""
    from nemo_jetrl.config import BackendSection, errors, load_config, validate

    seen = []
    section = BackendSection(
        validate=lambda section, path: [],
        validate_run=lambda settings: [],
        model_config=lambda section: None,
        validate_with_run=lambda section, keys, settings: seen.append((dict(section), keys)) or [],
    )
    cfg = load_config(EXAMPLES / "jetrl.yaml", [TOO_LONG, "grpo.seed=7"])
    assert errors(validate(cfg, {"local": lambda: section})) == []
    ((local, keys),) = seen
    assert keys["max_new_tokens"] == 300 and keys["seed"] == 7 and keys["max_num_steps"] == 16
    assert local["rollout_engine"] == "hf"  # the jetrl.local section
    seen.clear()
    bad = load_config(EXAMPLES / "jetrl.yaml", ["grpo.seed=-1"])
    assert [i.path for i in errors(validate(bad, {"local": lambda: section}))] == ["grpo.seed"]
    assert seen == []


def test_check_measures_the_longest_prompt_of_a_custom_tokenizer(capsys, tmp_path):
    """The check replays the run's data stream as the run does: with a tokenizer that gives
    prompts of one task different lengths, the longest training prompt counts (24 tokens)."""
    from test_local_seq_len import ONE_PROMPT, seven_tokenizer

    tok = seven_tokenizer(tmp_path / "seven.json")
    extra = (f"jetrl.local.tokenizer={tok}", "policy.generation.max_new_tokens=240")
    code, err = _cli(capsys, "check", str(EXAMPLES / "bf16.yaml"), *ONE_PROMPT, *extra)
    assert code == 2
    msg = _problems(err)["policy.generation.max_new_tokens"]
    assert "(24 tokens: training 24, validation 5) + max_new_tokens 240 = 264" in msg, msg
