"""Local backend: the GRPO plumbing learns, and the warm start plants the habit GRPO corrects.

Issue 18: every recipe's validation accuracy stayed flat (and collapsed at larger step sizes).
TRL's GRPOTrainer on the same warm start, task, batch and learning rate collapsed the same way
(benchmarks/bench_grpo_vs_trl.py), so the loop was not the cause: the warm-started policy was
mid-way through learning the arithmetic (groups mostly all-wrong, a sparse noisy signal that
AdamW turns into a random walk). These tests pin both halves:

- the plumbing: rollout logprobs are the trainer's (token/logit alignment, temperature), and
  a bandit-style GRPO run through the real `generate`, `group_advantages`, `Trainer.update`
  (clipped PG, fp32 masters, BF16 compute weights) and `refit` must raise the reward of a
  one-token target from chance to most of the batch within 6 steps, deterministically;
  mis-shifting the logprobs, flipping the advantage or losing the update each fails it;
- the warm start: ``early_answer_frac`` targets answer one step early, as documented.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from nemo_jetrl.backends.local.config import WarmStartSettings
from nemo_jetrl.backends.local.model import build_model, load_model_config
from nemo_jetrl.backends.local.refit import export_weights, refit
from nemo_jetrl.backends.local.rollout import generate
from nemo_jetrl.backends.local.task import (
    TaskConfig,
    chain_values,
    early_answer_target,
    make_problem,
    sample_problems,
)
from nemo_jetrl.backends.local.trainer import OptimConfig, Trainer, sequence_logprobs
from nemo_jetrl.backends.local.warmstart import warmstart_targets
from nemo_jetrl.rl.loss import group_advantages
from nemo_jetrl.rl.loss_config import GRPOLossConfig

EOS, PAD, TARGET = 2, 0, 9  # token ids: <eos>, <pad>, and the digit '6' the bandit rewards


def _model(dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    return build_model(load_model_config(), dtype=dtype, seed=seed)


def test_rollout_logprobs_are_the_trainers_at_the_sampled_tokens():
    """Alignment: logits at position t score the token at t+1, at the sampling temperature."""
    torch.manual_seed(0)
    model = _model(torch.float32)
    prompts = torch.randint(3, 19, (6, 5))
    prompts[:, 0] = 1
    for temp in (1.0, 0.7):
        rb = generate(
            model, prompts, max_new_tokens=6, temperature=temp, eos_id=EOS, pad_id=PAD,
            generator=torch.Generator().manual_seed(1),
        )  # fmt: skip
        ids = torch.cat([prompts, rb.response_ids], 1)
        with torch.no_grad():
            full = sequence_logprobs(model, ids, prompts.shape[1], temp)
        m = rb.response_mask
        assert m.any()
        torch.testing.assert_close(full[m], rb.generation_logprobs[m], atol=2e-5, rtol=0)
        # the off-by-one shift would score each token with the logits of its own position
        shifted = torch.log_softmax(
            model(input_ids=ids).logits[:, prompts.shape[1] :].float() / temp, -1
        ).gather(-1, ids[:, prompts.shape[1] :, None])[..., 0]
        assert (shifted[m] - rb.generation_logprobs[m]).abs().max() > 0.1


def _bandit_run(steps: int, *, flip_advantages: bool = False, lr: float = 3e-3) -> list[float]:
    """GRPO on a one-token bandit (reward 1 when the first response token is TARGET) through
    the real rollout, advantages, trainer and refit; returns the mean reward per step."""
    torch.manual_seed(0)
    policy = _model()
    rollout = copy.deepcopy(policy).eval()
    trainer = Trainer(
        policy, optim=OptimConfig(lr=lr), loss=GRPOLossConfig(reference_policy_kl_penalty=0.0),
        temperature=1.0,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    P, G = 8, 8
    prompts = torch.randint(3, 19, (P, 4), generator=gen)
    prompts[:, 0] = 1
    prompt_ids = prompts.repeat_interleave(G, 0)
    groups = torch.arange(P).repeat_interleave(G)
    rewards_per_step = []
    for _ in range(steps):
        refit(rollout, export_weights(trainer.model))
        rb = generate(
            rollout, prompt_ids, max_new_tokens=2, temperature=1.0, eos_id=EOS, pad_id=PAD,
            generator=gen,
        )  # fmt: skip
        rewards = (rb.response_ids[:, 0] == TARGET).double()
        rewards_per_step.append(float(rewards.mean()))
        adv = group_advantages(rewards, groups)
        ids = torch.cat([prompt_ids, rb.response_ids], 1)
        prev = trainer.score(ids, prompts.shape[1])
        trainer.update(
            ids, prompts.shape[1], prev_logprobs=prev, generation_logprobs=rb.generation_logprobs,
            advantages=-adv if flip_advantages else adv, token_mask=rb.response_mask,
        )  # fmt: skip
    return rewards_per_step


def test_grpo_plumbing_learns_a_one_token_bandit():
    r = _bandit_run(6)
    assert r[0] < 0.15, r  # chance: one of 32 ids
    assert sum(r[-2:]) / 2 > 0.6, r


def test_bandit_with_flipped_advantages_does_not_learn():
    """The check above fails when the update goes the wrong way (a sign error anywhere)."""
    r = _bandit_run(6, flip_advantages=True)
    assert sum(r[-2:]) / 2 < 0.1, r


# ------------------------------------------------------------------------------ warm start


def test_early_answer_target_worked_example():
    cfg = TaskConfig(num_ops=3)
    p = make_problem([3, 4, 9, 5], ["+", "-", "+"], cfg)
    assert chain_values(p) == [3, 7, 8, 3]
    assert p.target == "3+4=7;7-9=8;8+5=3;#3"
    assert early_answer_target(p) == "3+4=7;7-9=8;8+5=3;#8"
    one = make_problem([6, 7], ["*"], TaskConfig(num_ops=1))
    assert (one.target, early_answer_target(one)) == ("6*7=2;#2", "6*7=2;#6")


@pytest.mark.parametrize("frac", [0.0, 0.7, 1.0])
def test_warmstart_targets_answer_early_at_the_configured_rate(frac):
    task = TaskConfig(num_ops=2)
    probs = sample_problems(400, task, torch.Generator().manual_seed(0))
    out = warmstart_targets(probs, WarmStartSettings(early_answer_frac=frac), torch.Generator())
    early = [o.target != p.target for p, o in zip(probs, out, strict=True)]
    same_last = [chain_values(p)[-1] == chain_values(p)[-2] for p in probs]
    # a problem whose last operation leaves the value unchanged has identical targets
    rate = sum(early) / max(1, sum(not s for s in same_last))
    assert abs(rate - frac) < 0.07
    for p, o in zip(probs, out, strict=True):
        assert o.target.rsplit("#", 1)[0] == p.target.rsplit("#", 1)[0]  # steps untouched
        assert o.answer == p.answer  # the reward still checks the true answer


def test_warmstart_seed_fixes_the_cache_key_across_grpo_seeds():
    from nemo_jetrl.backends.local.warmstart import cache_key

    mc, task = load_model_config(), TaskConfig()
    key = lambda ws, seed: cache_key(mc, "tok", task, ws, seed)  # noqa: E731
    fixed = WarmStartSettings(seed=42)
    assert key(fixed, 1) == key(fixed, 2) == key(WarmStartSettings(), 42)
    assert key(WarmStartSettings(), 1) != key(WarmStartSettings(), 2)
    assert key(WarmStartSettings(early_answer_frac=0.5), 42) != key(WarmStartSettings(), 42)


def test_warmstart_settings_errors_name_their_keys():
    from nemo_jetrl.backends.local.config import validate_local_config

    issues = validate_local_config({"warmstart": {"early_answer_frac": 1.5, "seed": -1}})
    paths = sorted(i.path for i in issues if i.level == "error")
    assert paths == ["jetrl.local.warmstart.early_answer_frac", "jetrl.local.warmstart.seed"]
