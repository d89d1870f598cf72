"""Mismatch metrics: worked examples (arithmetic in comments) and a float64 loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_jetrl.rl.metrics import JETRL_PREFIX, metric_names, mismatch_metrics

LN2 = math.log(2.0)
NAN = float("nan")


def T(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def worked_batch(dtype=torch.float64):
    """3 rows x 4 positions. Valid tokens (token_mask and sample_mask):
    row 0: (g, p) = (ln .5, ln .25) -> d = p - g = -ln2, rho = 0.5
           (g, p) = (ln .25, ln .25) -> d = 0,      rho = 1
    row 1: (g, p) = (ln .25, ln .5) -> d = +ln2,    rho = 2
    row 2: dropped by sample_mask (its huge error must not count).
    Prompt / padding positions hold junk (NaN, -inf, big numbers) that must be ignored.
    """
    q, h = math.log(0.25), math.log(0.5)
    g = T([[0.0, h, q, NAN], [-7.0, q, -math.inf, 3.0], [0.0, -30.0, -1.0, -1.0]], dtype)
    p = T([[5.0, q, q, NAN], [0.0, h, 0.0, NAN], [0.0, 0.0, -1.0, -1.0]], dtype)
    tm = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1]])
    sm = torch.tensor([1, 1, 0])
    return g, p, tm, sm


def test_worked_example_every_metric():
    g, p, tm, sm = worked_batch()
    m = mismatch_metrics(g, p, tm, sm, ratio_bounds=(0.8, 1.5))
    J = JETRL_PREFIX
    expected = {
        # mean exp|d| = (2 + 1 + 2) / 3
        "train/token_mult_prob_error": 5.0 / 3.0,
        # k3(d) = e^d - d - 1: (0.5 + ln2 - 1) + 0 + (2 - ln2 - 1) = 0.5, / 3 tokens
        "train/gen_kl_error": 0.5 / 3.0,
        # k3(-d): (2 - ln2 - 1) + 0 + (0.5 + ln2 - 1) = 0.5, / 3
        "train/policy_kl_error": 0.5 / 3.0,
        # token (p=ln.25, g=ln.5): m = ln .375, p-m = ln(2/3), g-m = ln(4/3);
        # 0.5[(2/3 - ln(2/3) - 1) + (4/3 - ln(4/3) - 1)] = 0.5 ln(9/8); the mirrored token
        # gives the same, the equal one 0: (2 * 0.5 ln(9/8)) / 3
        "train/js_divergence_error": math.log(9.0 / 8.0) / 3.0,
        # per sequence: row0 (2 + 1)/2 = 1.5, row1 2/1 = 2
        "train/min_seq_mult_prob_error": 1.5,
        "train/mean_seq_mult_prob_error": 1.75,
        "train/max_seq_mult_prob_error": 2.0,
        J + "k1_kl": 0.0,  # mean(g - p) = (ln2 + 0 - ln2) / 3
        # row0: -(ln.25 + ln.25)/2 = 2 ln2; row1: -ln .5 = ln2 -> mean 1.5 ln2
        J + "train_log_ppl": 1.5 * LN2,
        # row0: -(ln.5 + ln.25)/2 = 1.5 ln2; row1: 2 ln2 -> mean 1.75 ln2
        J + "rollout_log_ppl": 1.75 * LN2,
        # per seq diffs: +0.5 ln2, -ln2
        J + "log_ppl_diff": -0.25 * LN2,
        J + "log_ppl_abs_diff": 0.75 * LN2,
        J + "ppl_ratio": (math.sqrt(2.0) + 0.5) / 2.0,
        # rho^2 = .25, 1, 4: mean 1.75, - 1
        J + "chi2_token": 0.75,
        # per seq prod rho: 0.5, 2 -> squares .25, 4: mean 2.125, - 1
        J + "chi2_seq": 1.125,
        J + "is_ratio_mean": 3.5 / 3.0,
        J + "is_ratio_std": math.sqrt(1.75 - (3.5 / 3.0) ** 2),  # sqrt(14)/6
        J + "is_ratio_min": 0.5,
        J + "is_ratio_max": 2.0,
        J + "is_ratio_ess": 3.5**2 / (3 * 5.25),  # 7/9
        J + "is_ratio_frac_above": 1.0 / 3.0,  # 2 > 1.5
        J + "is_ratio_frac_below": 1.0 / 3.0,  # 0.5 < 0.8
        # truncated: 0.8, 1, 1.5
        J + "is_ratio_trunc_mean": 3.3 / 3.0,
        J + "is_ratio_trunc_std": math.sqrt((0.64 + 1 + 2.25) / 3 - 1.1**2),
        J + "is_ratio_trunc_min": 0.8,
        J + "is_ratio_trunc_max": 1.5,
        J + "is_ratio_trunc_ess": 3.3**2 / (3 * 3.89),
        J + "num_valid_tokens": 3.0,
        J + "num_valid_seqs": 2.0,
        J + "nonfinite_tokens": 0.0,
    }
    assert set(m) == set(expected)
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, rel=1e-12, abs=1e-14), k


def test_names_are_nemo_rl_or_one_prefix():
    names = metric_names()
    nemo = {n for n in names if n.startswith("train/")}
    assert nemo == {
        "train/token_mult_prob_error",
        "train/gen_kl_error",
        "train/policy_kl_error",
        "train/js_divergence_error",
        "train/min_seq_mult_prob_error",
        "train/mean_seq_mult_prob_error",
        "train/max_seq_mult_prob_error",
    }
    assert all(n.startswith(JETRL_PREFIX) for n in set(names) - nemo)


def test_nemo_rl_docs_example_rare_token():
    # NeMo-RL docs/guides/grpo.md: logp_gen = -5, logp_policy = -15 on one token:
    # gen_kl = e^-10 + 10 - 1 ~ 9, policy_kl = e^10 - 10 - 1 ~ 22015
    m = mismatch_metrics(T([[-5.0]]), T([[-15.0]]), torch.ones(1, 1))
    assert m["train/gen_kl_error"] == pytest.approx(math.exp(-10) + 9.0, rel=1e-14)
    assert m["train/policy_kl_error"] == pytest.approx(math.exp(10) - 11.0, rel=1e-14)
    # NeMo-RL's JS formula: log m = log(.5 e^-15 + .5 e^-5)
    lm = math.log(0.5 * math.exp(-15) + 0.5 * math.exp(-5))
    k = lambda x: math.exp(x) - x - 1  # noqa: E731
    assert m["train/js_divergence_error"] == pytest.approx(0.5 * k(-15 - lm) + 0.5 * k(-5 - lm))
    assert m["train/token_mult_prob_error"] == pytest.approx(math.exp(10))


def test_nonfinite_valid_tokens_are_counted_and_excluded():
    # valid tokens: d = 0, NaN (gen NaN), -inf (prev -inf), 800 (exp overflows float64)
    g = T([[-1.0, NAN, -1.0, -900.0]])
    p = T([[-1.0, -1.0, -math.inf, -100.0]])
    m = mismatch_metrics(g, p, torch.ones(1, 4))
    assert m[JETRL_PREFIX + "nonfinite_tokens"] == 3.0
    assert m[JETRL_PREFIX + "num_valid_tokens"] == 1.0
    assert m["train/token_mult_prob_error"] == 1.0
    assert all(math.isfinite(v) for v in m.values())


def test_no_valid_token_gives_nan_not_zero():
    m = mismatch_metrics(T([[-1.0, -2.0]]), T([[-3.0, -4.0]]), torch.zeros(1, 2))
    assert math.isnan(m["train/token_mult_prob_error"])
    assert math.isnan(m["train/min_seq_mult_prob_error"])
    assert m[JETRL_PREFIX + "num_valid_tokens"] == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_are_computed_in_float64(dtype):
    # the metric of bf16/fp32 logprobs equals the float64 metric of the *same* (rounded) values
    torch.manual_seed(0)
    g = (-torch.rand(4, 33) * 8).to(dtype)
    p = (g.double() + torch.randn(4, 33) * 0.05).to(dtype)
    tm = (torch.rand(4, 33) > 0.3).long()
    lo = mismatch_metrics(g, p, tm)
    ref = mismatch_metrics(g.double(), p.double(), tm)
    for k in ref:
        assert lo[k] == ref[k], k  # bit-identical: the float64 path sees the same numbers


def _loop_reference(g, p, tm, sm, lo, hi):
    """Independent float64 loop over python floats for a few metrics."""
    toks, seqs = [], []
    for b in range(g.shape[0]):
        if sm is not None and not sm[b]:
            continue
        row = [(float(g[b, t]), float(p[b, t])) for t in range(g.shape[1]) if tm[b, t]]
        if row:
            seqs.append(row)
            toks.extend(row)
    d = [pp - gg for gg, pp in toks]
    n = len(d)
    rho = [math.exp(x) for x in d]
    seq_mpe = [sum(math.exp(abs(pp - gg)) for gg, pp in s) / len(s) for s in seqs]
    return {
        "train/token_mult_prob_error": sum(math.exp(abs(x)) for x in d) / n,
        "train/gen_kl_error": sum(math.exp(x) - x - 1 for x in d) / n,
        "train/policy_kl_error": sum(math.exp(-x) + x - 1 for x in d) / n,
        "train/max_seq_mult_prob_error": max(seq_mpe),
        JETRL_PREFIX + "chi2_token": sum(r * r for r in rho) / n - 1,
        JETRL_PREFIX + "chi2_seq": sum(math.exp(2 * sum(pp - gg for gg, pp in s)) for s in seqs)
        / len(seqs)
        - 1,
        JETRL_PREFIX + "is_ratio_frac_above": sum(r > hi for r in rho) / n,
        JETRL_PREFIX + "is_ratio_trunc_mean": sum(min(max(r, lo), hi) for r in rho) / n,
        JETRL_PREFIX + "train_log_ppl": sum(-sum(pp for _, pp in s) / len(s) for s in seqs)
        / len(seqs),
    }


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_batches_match_loop_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    g = -torch.rand(5, 17, generator=gen, dtype=torch.float64) * 6
    p = g + torch.randn(5, 17, generator=gen, dtype=torch.float64) * 0.3
    tm = torch.rand(5, 17, generator=gen) > 0.4
    sm = torch.tensor([1, 0, 1, 1, 1])
    g[~tm] = NAN  # padding junk
    m = mismatch_metrics(g, p, tm, sm, ratio_bounds=(0.7, 1.3))
    ref = _loop_reference(g, p, tm, sm, 0.7, 1.3)
    for k, v in ref.items():
        assert m[k] == pytest.approx(v, rel=1e-12), k


def test_bad_inputs_name_the_tensor():
    g = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="prev_logprobs"):
        mismatch_metrics(g, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="token_mask"):
        mismatch_metrics(g, g, torch.ones(3, 2))
    with pytest.raises(ValueError, match="sample_mask"):
        mismatch_metrics(g, g, torch.ones(2, 3), torch.ones(3))
    with pytest.raises(ValueError, match="ratio_bounds"):
        mismatch_metrics(g, g, torch.ones(2, 3), ratio_bounds=(2.0, 1.0))
