"""``policy.max_total_sequence_length`` on the local backend (`nemo_jetrl.backends.local.seq_len`):
a bound on prompt + response, as in NeMo-RL, held without cutting: a config whose longest prompt +
``max_new_tokens`` passes it is refused before any work, naming the key (NeMo-RL's engine would
cut those responses at its ``max_model_len``; a response cut before its ``<eos>`` is never
rewarded here).

Before: the key was not read at all. examples/configs/local/base.yaml set it to 64 and a
``jetrl.local.task.num_ops=8`` run made 74-token sequences (prompt 19 + 55 new tokens) without a
word; the shipped base now sets the 2-layer model's 256 positions, which the demo's length study
fits.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from local_configs import refused_issues, resolve_tiny, tiny_cfg

from nemo_jetrl.backends.local.loop import resolve_run

KEY = "policy.max_total_sequence_length"
EIGHT_OPS = ("jetrl.local.task.num_ops=8", "jetrl.local.warmstart.enabled=false")


_resolve, _issues = resolve_tiny, refused_issues


def test_a_sequence_past_it_is_refused_naming_it(tmp_path):
    found = _issues(tmp_path, f"{KEY}=64", *EIGHT_OPS)
    assert list(found) == [KEY]
    msg = found[KEY]
    assert msg.startswith(
        "the longest prompt (19 tokens: training 19, validation 19) + max_new_tokens 55 (null: "
        "the task's answer length 51 + 4) = 74 tokens, past max_total_sequence_length 64"
    ), msg
    assert "set policy.generation.max_new_tokens <= 45" in msg and f"raise {KEY} to >= 74" in msg


def test_up_to_it_runs_and_null_is_no_bound(tmp_path):
    at = _resolve(tmp_path, f"{KEY}=74", *EIGHT_OPS).lengths
    assert (at.longest_sequence, at.max_total) == (74, 74)  # the vLLM engine's max_model_len
    free = resolve_run(
        tiny_cfg("jetrl", tmp_path / "r2", tmp_path / "cache", f"{KEY}=null", *EIGHT_OPS)
    ).lengths
    assert free.max_total is None and free.longest_sequence == 74


def test_nemo_rl_s_idiom_is_refused_with_the_value_to_set(tmp_path):
    """NeMo-RL's configs write max_new_tokens: ${policy.max_total_sequence_length} and let the
    engine cut: here the config says how many new tokens fit."""
    found = _issues(tmp_path, f"{KEY}=128", "policy.generation.max_new_tokens=${" + KEY + "}")
    assert "+ max_new_tokens 128 = 133 tokens, past max_total_sequence_length 128" in found[KEY]
    assert "set policy.generation.max_new_tokens <= 123" in found[KEY]


def test_one_issue_at_the_tighter_bound(tmp_path):
    """Past both the key and the model's 256 positions: one issue, at the key (the tighter
    bound), whose first fix fits both; a bound above the model's positions leaves the model's
    issue at max_new_tokens (NeMo-RL-sized configs write 4096)."""
    both = _issues(tmp_path, f"{KEY}=64", "policy.generation.max_new_tokens=300")
    assert list(both) == [KEY] and "set policy.generation.max_new_tokens <= 59" in both[KEY]
    past = _issues(tmp_path, "jetrl.local.task.num_ops=31", f"{KEY}=64")
    assert "(up to the model's max_position_embeddings 256) with" in past[KEY]
    loose = _issues(tmp_path, f"{KEY}=4096", "policy.generation.max_new_tokens=300")
    assert list(loose) == ["policy.generation.max_new_tokens"]
    assert (
        "past the model's max_position_embeddings 256" in loose["policy.generation.max_new_tokens"]
    )
    assert _resolve(tmp_path, f"{KEY}=4096").lengths.max_total == 4096  # fits: runs


@pytest.mark.parametrize("value", ["0", "x", "1.5"])
def test_not_a_count_is_refused_by_the_validator(tmp_path, value):
    found = _issues(tmp_path, f"{KEY}={value}")
    assert "expected an integer in [1, 2147483647], or null" in found[KEY]


def test_the_shipped_local_configs_fit_the_demo_s_length_study(tmp_path):
    """The demo's packaged base (its length study's default --lengths) and the examples' base:
    every length runs, warm start included, under their max_total_sequence_length."""
    from nemo_jetrl.commands import demo

    lengths = (2, 4, 6, 8)  # `jetrl demo --study length`'s default --lengths: 74 tokens at 8
    for n in lengths:
        cfg = demo.recipe_config("jetrl", tmp_path / f"demo{n}", [f"jetrl.local.task.num_ops={n}"])
        assert resolve_run(cfg).lengths.max_total == 256
        shipped = resolve_run(tiny_cfg("jetrl", tmp_path / f"ex{n}", tmp_path / "c",
                                       f"jetrl.local.task.num_ops={n}"))  # fmt: skip
        assert shipped.lengths.longest_sequence <= shipped.lengths.max_total == 256
