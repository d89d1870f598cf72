"""GRPO loss against NeMo-RL itself (marker `nemo_rl`) on inputs `test_loss_vs_nemo_rl`'s random
batches do not have: advantages that differ per token, float32 logprobs (the dtype NeMo-RL's
workers hand the loss), and a batch with no valid token at all. Same comparison: NeMo-RL's
ClippedPGLossFn and our grpo_loss on the same tensors, loss, gradient and metrics.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_loss_vs_nemo_rl import NEMO_RL_CASES, _random_batch

from nemo_jetrl.rl.loss import GRPOLossConfig, grpo_loss

# one configuration per loss path: token mean, sequence mean, KL, the four IS corrections
# (seq-mask-tis with bounds that keep some sequences of these batches: a loss of 0 tests little)
CASES = {
    name: NEMO_RL_CASES[name]
    for name in ("plain", "seq_mean_kl", "kl_k3", "tis_ratio_min", "icepop", "gspo_tis")
}
CASES["seq_mask_tis"] = {
    **NEMO_RL_CASES["seq_mask_tis"],
    "truncated_importance_sampling_ratio": 1.02,
    "truncated_importance_sampling_ratio_min": 0.98,
}
METRICS = ("token_mult_prob_error", "gen_kl_error", "sampling_importance_ratio", "is_oob_ratio",
           "probs_ratio", "probs_ratio_clamped", "kl_penalty", "num_valid_samples")  # fmt: skip


def _pad(x: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's data tensors are input-aligned and sliced [:, 1:] inside: prepend a column."""
    return torch.cat([torch.zeros(x.shape[0], 1, dtype=x.dtype), x], dim=1)


def _both(name, curr, prev, gen, ref, adv_tok, tm, sm):
    """(their loss, grad, metrics), (our loss, grad, metrics) on one batch; adv_tok is [B, T]."""
    import nemo_rl.algorithms.loss.loss_functions as lf
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    cfg_dict = {"reference_policy_kl_penalty": 0.0, **CASES[name]}
    data = BatchedDataDict(
        {
            "advantages": _pad(adv_tok),
            "prev_logprobs": _pad(prev),
            "generation_logprobs": _pad(gen),
            "reference_policy_logprobs": _pad(ref),
            "token_mask": _pad(tm),
            "sample_mask": sm,
        }
    )
    gtok, gseq = (tm * sm.unsqueeze(-1)).sum(), sm.sum()
    fn = lf.ClippedPGLossFn(lf.ClippedPGLossConfig(**cfg_dict))
    t_curr, o_curr = curr.clone().requires_grad_(True), curr.clone().requires_grad_(True)
    t_loss, t_m = fn(t_curr, data, global_valid_seqs=gseq, global_valid_toks=gtok)
    t_loss.backward()
    o_loss, o_m = grpo_loss(
        o_curr, prev, gen, adv_tok, tm, sm,
        reference_logprobs=ref, config=GRPOLossConfig.from_loss_fn_cfg(cfg_dict),
    )  # fmt: skip
    o_loss.backward()
    o_m = {k.removeprefix("train/"): v for k, v in o_m.items()}
    return (t_loss, t_curr.grad, t_m), (o_loss, o_curr.grad, o_m)


def _per_token(adv: torch.Tensor, t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(adv.shape[0], t, generator=g, dtype=adv.dtype)
    return adv.unsqueeze(-1) + noise  # a different advantage at every token


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", sorted(CASES))
def test_per_token_advantages_match_nemo_rl(name):
    """NeMo-RL's data carries one advantage per token; ours takes [B, T] as well."""
    curr, prev, gen, ref, adv, tm, sm = _random_batch(len(name) + 3)
    (t_loss, t_g, _), (o_loss, o_g, _) = _both(
        name, curr, prev, gen, ref, _per_token(adv, tm.shape[1], 5), tm, sm
    )
    assert o_loss.item() == pytest.approx(t_loss.item(), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(o_g, t_g, rtol=1e-6, atol=1e-9)
    # control: the per-token advantages change the loss (a path that read only one column
    # per row would pass the rest of this test on per-response advantages)
    (_, _, _), (o_row, _, _) = _both(
        name, curr, prev, gen, ref, adv.unsqueeze(-1).expand_as(tm).contiguous(), tm, sm
    )
    assert abs(o_row.item() - o_loss.item()) > 1e-3


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", sorted(CASES))
def test_float32_inputs_match_nemo_rl(name):
    """float32 logprobs: both compute in float32; the two float32 results sit within float32's
    rounding of each other, measured against their gap to the float64 result (the control)."""
    batch64 = _random_batch(len(name) + 11)
    curr, prev, gen, ref, adv, tm, sm = (x.float() for x in batch64)
    adv_tok = _per_token(adv, tm.shape[1], 7)
    (t_loss, t_g, t_m), (o_loss, o_g, o_m) = _both(name, curr, prev, gen, ref, adv_tok, tm, sm)
    assert o_loss.dtype == t_loss.dtype == torch.float32
    c64, p64, g64, r64, tm64, sm64 = (x.double() for x in (curr, prev, gen, ref, tm, sm))
    (ref_loss, _, _), _ = _both(name, c64, p64, g64, r64, adv_tok.double(), tm64, sm64)
    bound = 4 * max(abs(t_loss.item() - ref_loss.item()), 1e-7 * abs(ref_loss.item()), 1e-9)
    assert abs(o_loss.item() - t_loss.item()) <= bound, (o_loss.item(), t_loss.item(), bound)
    torch.testing.assert_close(o_g, t_g, rtol=1e-5, atol=1e-7)
    for key in METRICS:
        if key in t_m and not (key == "sampling_importance_ratio" and "gspo" in name):
            assert o_m[key] == pytest.approx(t_m[key], rel=1e-5, abs=1e-7), key


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_batch_without_valid_tokens_matches_nemo_rl(name):
    """Every token masked (or every response dropped): no NaN in either loss or gradient, both
    zero; the token statistics are NaN on our side where NeMo-RL reports 0 (docs/metrics.md,
    deviation 4: nothing was measured; a 0 would read as a broken step)."""
    curr, prev, gen, ref, adv, tm, sm = _random_batch(len(name) + 13)
    for tm_, sm_ in ((torch.zeros_like(tm), sm), (tm, torch.zeros_like(sm))):
        adv_tok = adv.unsqueeze(-1).expand_as(tm).contiguous()
        (t_loss, t_g, t_m), (o_loss, o_g, o_m) = _both(
            name, curr, prev, gen, ref, adv_tok, tm_, sm_
        )
        assert t_loss.item() == 0.0 and o_loss.item() == 0.0
        assert torch.count_nonzero(t_g) == 0 and torch.count_nonzero(o_g) == 0
        assert torch.isfinite(o_g).all() and torch.isfinite(t_g).all()
        for key in ("token_mult_prob_error", "gen_kl_error", "probs_ratio"):
            assert t_m[key] == 0.0 and math.isnan(o_m[key]), (key, t_m[key], o_m[key])
        assert o_m["num_valid_samples"] == pytest.approx(t_m["num_valid_samples"])
