"""Edges of the loss's means that a micro-batched caller meets: a global batch with no valid
token or sequence (NeMo-RL's ``global_valid_toks`` 0, e.g. every ``sample_mask`` 0 after
``grpo.seq_logprob_error_threshold``), a global count below this call's own count, and
responses padded to zero columns with a sample mask. References are float64 sums written out.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_jetrl.rl.correction import CorrectionConfig
from nemo_jetrl.rl.loss import GRPOLossConfig, grpo_loss
from nemo_jetrl.rl.weights import importance_weights

NO_KL = GRPOLossConfig(reference_policy_kl_penalty=0.0)
SEQ = GRPOLossConfig(
    reference_policy_kl_penalty=0.0,
    token_level_loss=False,
    correction=CorrectionConfig.for_mode("sequence"),
)


def _batch(b: int = 3, t: int = 4):
    g = torch.Generator().manual_seed(5)
    gen = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    prev = gen + 0.01 * torch.randn(b, t, generator=g, dtype=torch.float64)
    curr = (prev + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return curr, prev, gen, adv


@pytest.mark.parametrize(
    ("cfg", "kw"),
    [(NO_KL, {"global_valid_tokens": 0.0}), (SEQ, {"global_valid_seqs": 0.0})],
    ids=["tokens", "seqs"],
)
def test_zero_global_count_gives_zero_loss_not_nan(cfg, kw):
    """NeMo-RL divides by (0 + 1e-8): loss 0. We divided by 0 and returned NaN."""
    curr, prev, gen, adv = _batch()
    tm = torch.ones(3, 4)
    loss, m = grpo_loss(curr, prev, gen, adv, tm, torch.zeros(3), config=cfg, **kw)
    assert loss.item() == 0.0 and m["train/loss"] == 0.0
    loss.backward()
    assert torch.equal(curr.grad, torch.zeros_like(curr))


@pytest.mark.parametrize(
    ("name", "kw", "cfg"),
    [
        ("global_valid_tokens", {"global_valid_tokens": 5.0}, NO_KL),
        ("global_valid_tokens", {"global_valid_tokens": math.nan}, NO_KL),
        ("global_valid_tokens", {"global_valid_tokens": math.inf}, NO_KL),
        ("global_valid_seqs", {"global_valid_seqs": 2.0}, SEQ),
    ],
)
def test_global_count_below_this_calls_count_is_refused(name, kw, cfg):
    """12 valid tokens / 3 sequences here: a global count below that (or not finite) cannot be
    the batch's; dividing by it would scale the loss and its gradient silently."""
    curr, prev, gen, adv = _batch()
    with pytest.raises(ValueError, match=name):
        grpo_loss(curr, prev, gen, adv, torch.ones(3, 4), config=cfg, **kw)


def test_global_count_scales_the_mean_exactly():
    """A valid global count still divides the float64 sum of this call's terms."""
    curr, prev, gen, adv = _batch()
    tm = torch.ones(3, 4)
    loss, _ = grpo_loss(curr, prev, gen, adv, tm, config=NO_KL, global_valid_tokens=20.0)
    r = torch.exp(curr.detach() - prev)
    a = adv.unsqueeze(-1)
    per = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
    assert loss.item() == pytest.approx(float(per.sum()) / 20.0, rel=1e-14)


def test_zero_length_responses_with_a_sample_mask():
    """[B, 0] logprobs (every response empty) with a sample mask: an empty batch (zero loss,
    NaN means), not an IndexError."""
    z = torch.zeros(2, 0, dtype=torch.float64)
    curr = z.clone().requires_grad_()
    sm = torch.tensor([1.0, 0.0])
    for cfg in (NO_KL, SEQ):
        loss, m = grpo_loss(curr, z, z, torch.ones(2), z, sm, config=cfg)
        assert loss.item() == 0.0 and math.isnan(m["train/token_mult_prob_error"])
    for mode in ("token", "seq-mask-tis", "sequence"):
        kw = {"ratio_max": 2.0, "ratio_min": 0.5} if mode == "seq-mask-tis" else {}
        res = importance_weights(z, z, z, sm, config=CorrectionConfig.for_mode(mode, **kw))
        assert res.weights.shape == (2, 0)


@pytest.mark.parametrize("token_level_loss", [True, False])
def test_no_sample_mask_keeps_every_response_an_empty_one_too(token_level_loss):
    """``sample_mask=None`` is every response kept (the docstring; NeMo-RL's global_valid_seqs
    = sum(sample_mask)): an empty response counts as a sequence adding 0 (found by review: with
    ``token_level_loss: false`` None left it out, 0.1652 where all-ones and NeMo-RL give 0.1416)."""
    cfg = GRPOLossConfig.from_loss_fn_cfg(
        {"reference_policy_kl_penalty": 0.0, "token_level_loss": token_level_loss}
    )
    curr = torch.tensor([[-1.0, -0.5], [-2.0, -0.1], [-0.3, -0.7]], dtype=torch.float64)
    prev, adv = curr - 0.05, torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    tm = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    out = {}
    for key, sm in (("none", None), ("ones", torch.ones(3, dtype=torch.float64))):
        loss, m = grpo_loss(curr, prev, prev.clone(), adv, tm, sm, config=cfg)
        out[key] = (loss.item(), m["train/num_valid_samples"])
    assert out["none"] == out["ones"] and out["ones"][1] == 3.0, out
