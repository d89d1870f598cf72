"""The warm start's sequences against the model's positions (`nemo_jetrl.backends.local.seq_len`):
it trains on a prompt + the task's full answer whatever ``max_new_tokens`` says, so a config whose
rollouts fit can still send it past ``max_position_embeddings``; refused before any work (one
issue, at ``jetrl.local.task.num_ops``), with a backstop in the warm start itself.

Before: ``jetrl.local.task.num_ops=32 policy.generation.max_new_tokens=10`` passed the rollouts'
rule (67 + 10 = 77 positions of 256) and the warm start trained on 67 + 195 = 262 positions, six
past the table, without a word (HF's plain rotary computes any position).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("transformers")

from local_configs import REPO, refused_issues, resolve_tiny, tiny_cfg

from nemo_jetrl.backends.local.loop import resolve_run

KEY = "jetrl.local.task.num_ops"
SHORT_ROLLOUTS = ("jetrl.local.task.num_ops=32", "policy.generation.max_new_tokens=10")


_resolve, _issues = resolve_tiny, refused_issues


def test_a_warm_start_past_the_table_is_refused_when_the_rollouts_fit(tmp_path):
    found = _issues(tmp_path, *SHORT_ROLLOUTS)
    assert list(found) == [KEY], found  # the rollouts (77 positions) fit
    msg = found[KEY]
    assert "full answer (<eos> included) of up to 262 tokens" in msg, msg
    assert "past the model's max_position_embeddings 256" in msg
    assert "lower jetrl.local.task.num_ops (now 32)" in msg
    assert (
        "set jetrl.local.warmstart.enabled=false" in msg and "max_position_embeddings >= 262" in msg
    )
    # no warm start, nothing to refuse
    off = _resolve(tmp_path, *SHORT_ROLLOUTS, "jetrl.local.warmstart.enabled=false").lengths
    assert (off.warmstart, off.longest_sequence) == (0, 77)
    no_steps = resolve_run(tiny_cfg("jetrl", tmp_path / "r2", tmp_path / "cache", *SHORT_ROLLOUTS,
                                    "jetrl.local.warmstart.steps=0"))  # fmt: skip
    assert no_steps.lengths.warmstart == 0


def test_with_the_rollouts_past_it_too_both_are_named(tmp_path):
    """Default max_new_tokens (answer + 4): the rollouts' issue and the warm start's, each at its
    key (lowering max_new_tokens alone would leave the warm start past the table)."""
    found = _issues(tmp_path, "jetrl.local.task.num_ops=32")
    assert set(found) == {KEY, "policy.generation.max_new_tokens"}


def test_a_smaller_model_s_table(tmp_path):
    """A 64-position model: 8 operations warm-start on 19 + 51 = 70 positions (refused), 7 on
    17 + 45 = 62 (runs); the rollouts' 10 new tokens fit both."""
    cfg = json.loads((REPO / "nemo_jetrl/backends/local/assets/model_config.json").read_text())
    small = tmp_path / "small.json"
    small.write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    common = (f"jetrl.local.model_config={small}", "policy.generation.max_new_tokens=10")
    found = _issues(tmp_path, "jetrl.local.task.num_ops=8", *common)
    assert list(found) == [KEY] and "of up to 70 tokens" in found[KEY]
    ok = _resolve(tmp_path, "jetrl.local.task.num_ops=7", *common).lengths
    assert (ok.warmstart, ok.max_positions) == (62, 64)


def test_the_warm_start_itself_refuses_the_positions_past_the_table():
    """The backstop (as the HF rollout has its own): called directly, past the table it raises
    before its first step instead of training those positions."""
    from nemo_jetrl.backends.local.config import WarmStartSettings
    from nemo_jetrl.backends.local.model import load_model_config
    from nemo_jetrl.backends.local.task import TaskConfig
    from nemo_jetrl.backends.local.tokenizer import load_tokenizer
    from nemo_jetrl.backends.local.warmstart import train_warmstart

    ws = WarmStartSettings(steps=1, batch_size=2)
    with pytest.raises(ValueError, match="262 tokens is past the model's max_position_embeddings"):
        train_warmstart(load_model_config(), load_tokenizer(), TaskConfig(num_ops=32), ws, 0)
    # the stream is the one measured: 31 operations fill 254 of the 256 positions and train
    weights = train_warmstart(load_model_config(), load_tokenizer(), TaskConfig(num_ops=31),
                              replace(ws, batch_size=1), 0)  # fmt: skip
    assert weights
