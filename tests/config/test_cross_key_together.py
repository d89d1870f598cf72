"""The rules across keys (responses per step, the local backend's sequence lengths) are named
with the keys' own problems, not after them (bad-input review, session 41: a bad key hid every
rule across keys until it was mended). A rule runs on the keys that parsed, and never on a
default standing in for a key whose value failed (that would name a problem the user's value
may not have)."""

from __future__ import annotations

import ast
from pathlib import Path

from nemo_jetrl.backends.local.seq_len import MEASURE_READS
from nemo_jetrl.config.nemo_rl_model import RunConfig, value_at
from nemo_jetrl.config.typed import parse_leaves, parse_rest

REPO = Path(__file__).resolve().parents[2]
LOCAL = str(REPO / "examples/configs/local/jetrl.yaml")
SEQ = "past max_total_sequence_length"
SHORT = "policy.max_total_sequence_length=8"  # the demo's prompts + answers need 18 tokens


def test_the_sequence_rule_is_named_with_a_bad_key_it_does_not_read(cli):
    code, out = cli("check", LOCAL, "policy.optimizer.kwargs.lr=abc", SHORT)
    assert code == 2, out
    assert "2 problems" in out and "policy.optimizer.kwargs.lr: got 'abc'" in out, out
    assert SEQ in out, out
    code, out = cli("check", LOCAL, SHORT)  # control: the rule alone says the same
    assert code == 2 and SEQ in out and "1 problem" in out, out


def test_train_names_both_before_any_work(cli, tmp_path):
    log = tmp_path / "run"
    code, out = cli(
        "train", LOCAL, f"logger.log_dir={log}", "grpo.val_period=x", SHORT, "--backend", "local"
    )
    assert code == 2 and "grpo.val_period: got 'x'" in out and SEQ in out, out
    assert not log.exists()


def test_a_rule_reading_a_failed_key_is_not_run_on_its_default(cli):
    # the seed picks the prompts the rule measures: measuring the default seed's would be a guess
    code, out = cli("check", LOCAL, "grpo.seed=abc", SHORT)
    assert code == 2 and "grpo.seed: got 'abc'" in out and SEQ not in out, out
    code, out = cli("check", LOCAL, "policy.max_total_sequence_length=abc")
    assert code == 2 and "1 problem" in out and SEQ not in out, out
    for bad in ("grpo.seed=${nope}", "policy.generation.max_new_tokens=${nope}"):  # unresolvable
        code, out = cli("check", LOCAL, bad, SHORT)
        assert code == 2 and "cannot resolve" in out and SEQ not in out, (bad, out)


def test_responses_per_step_is_named_with_a_bad_sibling(cli):
    big = ["grpo.num_prompts_per_step=100000", "grpo.num_generations_per_prompt=100000"]
    code, out = cli("check", LOCAL, "grpo.max_num_steps=abc", *big)
    assert code == 2, out
    assert "grpo.max_num_steps: got 'abc'" in out and "responses per step exceeds" in out, out


def test_parse_leaves_keeps_a_failing_keys_siblings_where_parse_rest_drops_its_section():
    data = {"grpo": {"max_num_steps": "abc", "seed": 7}, "policy": {"max_grad_norm": 1.0}}
    leaves, issues = parse_leaves(RunConfig, data)
    rest, same = parse_rest(RunConfig, data)
    assert [i.path for i in issues] == [i.path for i in same] == ["grpo.max_num_steps"]
    assert leaves is not None and rest is not None
    assert value_at(leaves, "grpo.seed") == 7 and value_at(leaves, "policy.max_grad_norm") == 1.0
    assert value_at(rest, "grpo.seed") is not value_at(leaves, "grpo.seed")  # section dropped
    bad_list = {"policy": {"optimizer": {"kwargs": {"betas": ["a", 0.9], "lr": 1e-3}}}}
    model, issues = parse_leaves(RunConfig, bad_list)
    assert issues and model is not None
    assert value_at(model, "policy.optimizer.kwargs.lr") == 1e-3


def test_measure_reads_no_run_key_outside_measure_reads():
    """`MEASURE_READS` is what the validator trusts: every ``run.X`` `measure` and its helpers
    read must be in it, or a failed X would be measured as its default."""
    tree = ast.parse((REPO / "nemo_jetrl/backends/local/seq_len.py").read_text())
    read = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "run"
    }
    assert read and read <= MEASURE_READS, read - MEASURE_READS


def test_an_optimizer_the_local_backend_lacks_does_not_hide_the_sequence_rule(cli):
    """The rule does not read the optimizer: both are named in one pass (review, session 43)."""
    code, out = cli("check", LOCAL, "policy.optimizer.name=SGD", SHORT)
    assert code == 2 and "2 problems" in out, out
    assert "policy.optimizer.name" in out and SEQ in out, out
