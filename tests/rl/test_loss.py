"""GRPO loss: worked numbers for advantages, clipping, dual clip, IS weights, KL and aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_jetrl.rl.correction import CorrectionConfig
from nemo_jetrl.rl.loss import GRPOLossConfig, LossConfigError, group_advantages, grpo_loss

LN = math.log
NAN = float("nan")


def test_group_advantages_leave_one_out_normalised():
    # group 0 rewards [1, 0, 0, 1]; for a reward-1 response the others are [0, 0, 1]:
    # baseline 1/3, unbiased std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    # A = (1 - 1/3) / (sqrt(1/3) + 1e-6); a reward-0 response: others [0, 1, 1] -> -(2/3)/...
    # group 1 [2, 2]: std 0 -> not sharpened, A = 0; group 2 has one response -> A = 0
    a = group_advantages([1, 0, 0, 1, 2, 2, 5], [0, 0, 0, 0, 1, 1, 2])
    s = math.sqrt(1 / 3) + 1e-6
    exp = [2 / 3 / s, -2 / 3 / s, -2 / 3 / s, 2 / 3 / s, 0, 0, 0]
    torch.testing.assert_close(a, torch.tensor(exp, dtype=torch.float64), rtol=1e-14, atol=0)


def test_group_advantages_plain_mean_and_no_std():
    # plain baseline 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    a = group_advantages([1, 0, 0, 1], ["p", "p", "p", "p"], leave_one_out_baseline=False)
    s = math.sqrt(1 / 3) + 1e-6
    torch.testing.assert_close(
        a, torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], dtype=torch.float64)
    )
    a = group_advantages(
        torch.tensor([1.0, 0, 0, 1]), torch.tensor([7, 7, 7, 7]), normalize_rewards=False
    )
    torch.testing.assert_close(a, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3], dtype=torch.float64))


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="group_ids has 2 entries"):
        group_advantages([1.0, 2.0, 3.0], [0, 0])
    with pytest.raises(ValueError, match="rewards must be finite"):
        group_advantages([1.0, NAN], [0, 0])


def worked():
    """prev = gen = 0 (no mismatch: IS weights 1). PPO ratios r = exp(curr - prev):
    row 0 (A = +1): r = 1.5, 0.9, 1.0
    row 1 (A = -1): r = 0.5, 1.1, 3.5
    """
    curr = torch.tensor(
        [[LN(1.5), LN(0.9), 0.0], [LN(0.5), LN(1.1), LN(3.5)]],
        dtype=torch.float64,
        requires_grad=True,
    )
    z = torch.zeros(2, 3, dtype=torch.float64)
    return (
        curr,
        z.clone(),
        z.clone(),
        torch.tensor([1.0, -1.0], dtype=torch.float64),
        torch.ones(2, 3),
    )


NO_KL = GRPOLossConfig(reference_policy_kl_penalty=0.0)


def test_clipped_pg_worked_numbers_and_gradient():
    curr, prev, gen, adv, tm = worked()
    loss, m = grpo_loss(curr, prev, gen, adv, tm, config=NO_KL)
    # row 0: -A r = -1.5, -0.9, -1.0; clipped r = 1.2, 0.9, 1.0 -> -1.2, -0.9, -1.0;
    #        max -> -1.2, -0.9, -1.0
    # row 1: -A r = 0.5, 1.1, 3.5; clipped r = 0.8, 1.1, 1.2 -> 0.8, 1.1, 1.2; max -> 0.8, 1.1, 3.5
    # token mean: (-3.1 + 5.4) / 6 = 2.3 / 6
    assert loss.item() == pytest.approx(2.3 / 6, rel=1e-14)
    assert m["train/loss"] == pytest.approx(2.3 / 6, rel=1e-14)
    loss.backward()
    # d/dcurr of -A r / 6 = -A r / 6 where the unclipped term is chosen, 0 where clipped
    exp = torch.tensor([[0.0, -0.9 / 6, -1.0 / 6], [0.0, 1.1 / 6, 3.5 / 6]], dtype=torch.float64)
    torch.testing.assert_close(curr.grad, exp, rtol=1e-14, atol=1e-16)
    assert m["train/probs_ratio"] == pytest.approx((1.5 + 0.9 + 1 + 0.5 + 1.1 + 3.5) / 6)
    assert m["train/probs_ratio_clamped"] == pytest.approx((1.2 + 0.9 + 1 + 0.8 + 1.1 + 1.2) / 6)
    assert m["train/probs_ratio_max"] == pytest.approx(3.5)
    assert m["train/probs_ratio_clamped_min"] == pytest.approx(0.8)
    assert m["train/num_valid_samples"] == 2.0


def test_dual_clip():
    curr, prev, gen, adv, tm = worked()
    cfg = GRPOLossConfig(reference_policy_kl_penalty=0.0, ratio_clip_c=3.0)
    loss, _ = grpo_loss(curr, prev, gen, adv, tm, config=cfg)
    # row 1 token 2: min(3.5, -A c = 3) = 3 -> total -3.1 + 0.8 + 1.1 + 3 = 1.8
    assert loss.item() == pytest.approx(1.8 / 6, rel=1e-14)
    loss.backward()
    assert curr.grad[1, 2].item() == 0.0  # dual-clipped: constant


def test_importance_weights_multiply_tokens():
    curr, prev, _, adv, tm = worked()
    # rollout logprobs such that rho = exp(prev - gen) = 2 on row 0 token 0, 0.25 on row 1 token 2
    gen = torch.zeros(2, 3, dtype=torch.float64)
    gen[0, 0], gen[1, 2] = -LN(2.0), LN(4.0)
    cfg = GRPOLossConfig(
        reference_policy_kl_penalty=0.0, correction=CorrectionConfig.for_mode("tis", ratio_max=1.5)
    )
    loss, m = grpo_loss(curr, prev, gen, adv, tm, config=cfg)
    # weights after tis: 1.5 (2 clamped), 1, 1 / 1, 1, 0.25
    # sum: -1.2*1.5 - 0.9 - 1.0 + 0.8 + 1.1 + 3.5*0.25 = -1.8 - 1.9 + 1.9 + 0.875 = -0.925
    assert loss.item() == pytest.approx(-0.925 / 6, rel=1e-13)
    assert m["train/is_oob_ratio"] == pytest.approx(1 / 6)
    assert m["train/sampling_importance_ratio"] == pytest.approx((1.5 + 4 + 0.25) / 6)
    # mismatch metric from the same batch: exp|d| = 2, 1, 1, 1, 1, 4 -> 10 / 6
    assert m["train/token_mult_prob_error"] == pytest.approx(10 / 6)


def test_k3_kl_penalty_value_and_score_function_gradient():
    curr, prev, gen, adv, tm = worked()
    ref = curr.detach() + LN(2.0)  # x = ref - curr = ln 2 everywhere
    cfg = GRPOLossConfig(reference_policy_kl_penalty=0.1)
    loss, m = grpo_loss(curr, prev, gen, adv, tm, reference_logprobs=ref, config=cfg)
    k3 = 2 - LN(2.0) - 1  # e^x - x - 1 = 1 - ln2
    assert m["train/kl_penalty"] == pytest.approx(k3, rel=1e-14)
    assert loss.item() == pytest.approx(2.3 / 6 + 0.1 * k3, rel=1e-14)
    loss.backward()
    # row 0 token 0 is PPO-clipped (no actor gradient); KL term per token:
    # d/dc [k3(ref - c) * exp(c - sg(c))] = -(e^x - 1) + k3(x) = -1 + (1 - ln2) = -ln2, times 0.1/6
    assert curr.grad[0, 0].item() == pytest.approx(0.1 * -LN(2.0) / 6, rel=1e-13)


def test_kl_requires_reference_logprobs():
    curr, prev, gen, adv, tm = worked()
    with pytest.raises(ValueError, match="reference_logprobs is required"):
        grpo_loss(curr, prev, gen, adv, tm)


def test_padding_and_sample_mask_never_leak_nan():
    curr, prev, gen, adv, _ = worked()
    tm = torch.tensor([[1, 1, 0], [1, 1, 1]])
    prev[0, 2] = NAN
    gen[0, 2] = -math.inf
    c = curr.detach().clone()
    c[0, 2] = NAN
    c.requires_grad_(True)
    loss, m = grpo_loss(c, prev, gen, adv, tm, sample_mask=torch.tensor([1, 0]), config=NO_KL)
    # only row 0 tokens 0, 1 count: (-1.2 - 0.9) / 2
    assert loss.item() == pytest.approx(-2.1 / 2, rel=1e-14)
    loss.backward()
    assert torch.isfinite(c.grad).all()
    assert c.grad[1].abs().sum() == 0 and c.grad[0, 2] == 0
    assert m["train/num_valid_samples"] == 1.0


def test_global_token_mean_over_micro_batches():
    curr, prev, gen, adv, tm = worked()
    full, _ = grpo_loss(curr, prev, gen, adv, tm, config=NO_KL)
    parts = [
        grpo_loss(
            curr[i : i + 1],
            prev[i : i + 1],
            gen[i : i + 1],
            adv[i : i + 1],
            tm[i : i + 1],
            config=NO_KL,
            global_valid_tokens=6,
        )[0]
        for i in range(2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-14)


def test_sequence_level_loss_and_gspo_ratio():
    curr, prev, gen, adv, _ = worked()
    tm = torch.tensor([[1, 1, 0], [1, 1, 1]])
    cfg = GRPOLossConfig(
        reference_policy_kl_penalty=0.0,
        token_level_loss=False,
        correction=CorrectionConfig.for_mode("sequence"),
    )
    loss, _ = grpo_loss(curr, prev, gen, adv, tm, config=cfg)
    # sequence ratios: row 0 exp((ln1.5 + ln0.9)/2) = sqrt(1.35); row 1 (0.5*1.1*3.5)^(1/3)
    r0, r1 = math.sqrt(1.35), (0.5 * 1.1 * 3.5) ** (1 / 3)
    l0 = max(-r0, -min(r0, 1.2))  # A = +1
    l1 = max(r1, min(max(r1, 0.8), 1.2))  # A = -1
    # IS weights are 1 (prev == gen); per-sequence token means are l0, l1; mean over 2 sequences
    assert loss.item() == pytest.approx((l0 + l1) / 2, rel=1e-13)


def test_loss_config_from_nemo_rl_loss_fn():
    cfg = {
        "reference_policy_kl_penalty": 0.01,
        "reference_policy_kl_type": "k3",
        "kl_input_clamp_value": 20.0,
        "kl_output_clamp_value": 10.0,
        "ratio_clip_min": 0.2,
        "ratio_clip_max": 0.28,
        "ratio_clip_c": None,
        "use_on_policy_kl_approximation": False,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
        "truncated_importance_sampling_ratio_min": None,
        "sequence_level_importance_ratios": False,
        "token_level_loss": True,
        "force_on_policy_ratio": False,
        "use_kl_in_reward": False,
    }
    c = GRPOLossConfig.from_loss_fn_cfg(cfg)
    assert c.ratio_clip_max == 0.28 and c.correction.mode == "tis"
    bad = {
        **cfg,
        "ratio_clip_c": 0.5,
        "use_cispo": True,
        "reference_policy_kl_type": "k9",
        "truncated_importance_sampling_ratio": -2.0,
    }
    with pytest.raises(LossConfigError, match="invalid loss_fn settings") as ei:
        GRPOLossConfig.from_loss_fn_cfg(bad)
    text = str(ei.value)
    for needle in (
        "loss_fn.ratio_clip_c got 0.5; expected a finite number > 1",
        "loss_fn.use_cispo=True is not implemented",
        "loss_fn.reference_policy_kl_type got 'k9'; expected one of",
        "loss_fn.truncated_importance_sampling_ratio must be a positive",
    ):
        assert needle in text, text
    assert len(ei.value.errors) == 4


@pytest.mark.parametrize("key", ["reference_policy_kl_penalty", "ratio_clip_min", "ratio_clip_c"])
def test_non_finite_loss_keys_are_refused(key):
    """Issue 26: ``reference_policy_kl_penalty: .inf`` was accepted where ``lr: .inf`` was not."""
    with pytest.raises(LossConfigError, match=f"loss_fn.{key} got inf; expected a finite"):
        GRPOLossConfig.from_loss_fn_cfg({key: float("inf")})
    with pytest.raises(LossConfigError, match=f"{key} got inf; expected a finite"):
        GRPOLossConfig(**{key: float("inf")})
    with pytest.raises(LossConfigError, match=f"loss_fn.{key} got 'true'; expected"):
        GRPOLossConfig.from_loss_fn_cfg({key: "true"})


def test_empty_batch_gives_zero_loss_and_nan_metrics():
    curr, prev, gen, adv, _ = worked()
    loss, m = grpo_loss(curr, prev, gen, adv, torch.zeros(2, 3), config=NO_KL)
    assert loss.item() == 0.0
    loss.backward()
    assert curr.grad.abs().sum() == 0
    assert math.isnan(m["train/probs_ratio"]) and math.isnan(m["train/token_mult_prob_error"])


def test_token_level_flags_must_agree():
    with pytest.raises(LossConfigError, match="token_level_loss=False but correction"):
        GRPOLossConfig(token_level_loss=False)
