"""``policy.train_global_batch_size`` below a step's responses: NeMo-RL takes several optimizer
steps per GRPO step, the local backend one over all responses. The key was not read at all, so a
NeMo-RL-shaped config trained differently here without a word (RL numerics review, session 38);
the run says so, and the key is typed as NeMo-RL's (a count of responses)."""

from __future__ import annotations

import pytest
from local_configs import EXAMPLES

from nemo_jetrl.backends.local.setup import resolve_run
from nemo_jetrl.config import ConfigError, load_config

JETRL = EXAMPLES / "jetrl.yaml"
STEP = ("grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=8")  # 32 responses


def _run(*extra: str):
    return resolve_run(load_config(JETRL, [*STEP, *extra])).run


def test_a_smaller_global_batch_is_named_as_not_honoured():
    note = _run("+policy.train_global_batch_size=8").global_batch_note()
    assert note is not None and note.startswith("policy.train_global_batch_size=8 is not honoured")
    assert "one optimizer step per GRPO step over all 32 responses" in note
    assert "NeMo-RL takes 4 of 8 responses each" in note


def test_a_global_batch_nemo_rl_would_not_train_on_is_said():
    """NeMo-RL's Megatron worker takes ``responses // gbs`` optimizer steps (diff review):
    a larger global batch trains nothing there, a non-dividing one leaves responses out."""
    big = _run("+policy.train_global_batch_size=64").global_batch_note()
    assert big is not None and "exceeds the 32 responses" in big and "no optimizer step" in big
    odd = _run("+policy.train_global_batch_size=12").global_batch_note()
    assert odd is not None and "takes 2 of 12 responses each, leaving 8 responses out" in odd


@pytest.mark.parametrize("extra", [(), ("+policy.train_global_batch_size=32",)])
def test_one_step_per_grpo_step_says_nothing(extra):
    assert _run(*extra).global_batch_note() is None


def test_the_key_is_typed_as_nemo_rls():
    with pytest.raises(ConfigError) as ei:
        _run("+policy.train_global_batch_size=0")
    assert "policy.train_global_batch_size: got 0" in str(ei.value)
