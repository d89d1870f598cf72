"""GRPO loss, IS weights and mismatch metrics against an independent float64 reference.

The reference below is plain Python over floats (``math`` only; it calls nothing under test),
written from the formulas in docs/metrics.md and the nemo_jetrl.rl docstrings, with the
gradient written out by hand: a finite difference cannot see a stop-gradient, and where a
detach matters (the KL input clamp, the score-function weight exp(curr - sg(curr))) the
gradient is what the loss means. The worked examples are asymmetric on purpose (clip range
[0.9, 1.3], mixed-sign advantages, log-ratios that do not cancel) so that each plausible slip
(a swapped bound, a lost 1/2, a flipped sign, an ignored clamp or denominator) changes a number.
scripts/mutation_check.py applies such slips one at a time and checks that this suite fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_jetrl.rl.correction import CorrectionConfig
from nemo_jetrl.rl.loss import GRPOLossConfig, grpo_loss
from nemo_jetrl.rl.metrics import JETRL_PREFIX, mismatch_metrics
from nemo_jetrl.rl.weights import importance_weights

LN = math.log
J = JETRL_PREFIX
REL = 1e-12


# ------------------------------------------------------------------------------ the reference


def ref_kl(x: float, kl_type: str) -> tuple[float, float]:
    """(K(x), dK/dx) of Schulman's estimators for x = log(q/p)."""
    if kl_type == "k1":
        return -x, -1.0
    if kl_type == "k2":
        return x * x / 2, x
    return math.exp(x) - x - 1, math.exp(x) - 1


def ref_weights(gen, prev, valid, mode="none", lo=None, hi=None):
    """IS weight per token: none 1, token rho, tis clamp(rho, lo or 0, hi), icepop rho in
    [lo, hi] else 0, seq-mask-tis rho if the row's geometric-mean ratio is in [lo, hi] else 0."""
    out = []
    for g_row, p_row, v_row in zip(gen, prev, valid, strict=True):
        ds = [p - g for g, p, v in zip(g_row, p_row, v_row, strict=True) if v]
        geo = math.exp(sum(ds) / len(ds)) if ds else 1.0
        row = []
        for g, p, v in zip(g_row, p_row, v_row, strict=True):
            rho = math.exp(p - g)
            w = {
                "none": 1.0,
                "token": rho,
                "tis": min(max(rho, lo or 0.0), hi or 0.0),
                "icepop": rho if mode == "icepop" and lo <= rho <= hi else 0.0,
                "seq-mask-tis": rho if mode == "seq-mask-tis" and lo <= geo <= hi else 0.0,
            }[mode]
            row.append(w if v else 0.0)
        out.append(row)
    return out


def ref_token_terms(c, p, g, a, w, r, cfg):
    """(value, d value / d curr) of one token's loss before aggregation."""
    ratio = math.exp(c - p)
    lo, hi = 1 - cfg["ratio_clip_min"], 1 + cfg["ratio_clip_max"]
    clamped = min(max(ratio, lo), hi)
    u, v = -a * ratio, -a * clamped
    if u > v or lo < ratio < hi:  # the unclipped branch is the pessimistic one (or no clip)
        val, grad = u, -a * ratio
    else:
        val, grad = v, 0.0
    dual = cfg.get("ratio_clip_c")
    if dual is not None and a < 0 and val > -a * dual:
        val, grad = -a * dual, 0.0
    val, grad = w * val, w * grad
    beta = cfg.get("reference_policy_kl_penalty", 0.0)
    if beta:
        x = r - c
        kw = math.exp(c - g) if cfg.get("use_on_policy_kl_approximation") else 1.0
        kl_type = cfg.get("reference_policy_kl_type", "k3")  # GRPOLossConfig's defaults
        cin, cout = cfg.get("kl_input_clamp_value", 20.0), cfg.get("kl_output_clamp_value", 10.0)
        if cin is not None and abs(x) > cin:  # clamped: constant x and a detached weight
            k = ref_kl(math.copysign(cin, x), kl_type)[0] * kw
            kg = 0.0
        else:
            k0, dk = ref_kl(x, kl_type)
            k, kg = k0 * kw, (-dk + k0) * kw  # d kw / d curr = kw in both weightings
        if cout is not None and abs(k) > cout:
            k, kg = math.copysign(cout, k), 0.0
        val, grad = val + beta * k, grad + beta * kg
    return val, grad


def ref_grpo(
    curr, prev, gen, adv, valid, seq_kept, cfg, ref=None, weights=None, gtok=None, gseq=None
):
    """(loss, dloss/dcurr) with NeMo-RL's aggregation: global token mean, or (token_level_loss
    false) mean over kept sequences of each sequence's token mean."""
    b, t = len(curr), len(curr[0])
    ref = ref or [[0.0] * t for _ in range(b)]
    weights = weights or [[1.0] * t for _ in range(b)]
    n_tok = sum(sum(row) for row in valid)
    tok_den = gtok if gtok is not None else max(n_tok, 1)
    seq_den = gseq if gseq is not None else max(sum(seq_kept), 1)
    loss, grad = 0.0, [[0.0] * t for _ in range(b)]
    for i in range(b):
        n_i = max(sum(valid[i]), 1)
        scale = 1 / tok_den if cfg.get("token_level_loss", True) else 1 / (n_i * seq_den)
        for j in range(t):
            if valid[i][j]:
                val, gr = ref_token_terms(
                    curr[i][j], prev[i][j], gen[i][j], adv[i], weights[i][j], ref[i][j], cfg
                )
                loss += val * scale
                grad[i][j] = gr * scale
    return loss, grad


def ref_metrics(gen, prev, valid, kl_type="k3"):
    """A few mismatch metrics over valid tokens / sequences (chi2_seq: row sum clamped to 50)."""
    seqs = [
        [p - g for g, p, v in zip(gr, pr, vr, strict=True) if v]
        for gr, pr, vr in zip(gen, prev, valid, strict=True)
    ]
    seqs = [s for s in seqs if s]
    d = [x for s in seqs for x in s]
    n = len(d)
    seq_mpe = [sum(math.exp(abs(x)) for x in s) / len(s) for s in seqs]
    return {
        "train/token_mult_prob_error": sum(math.exp(abs(x)) for x in d) / n,
        "train/gen_kl_error": sum(ref_kl(x, kl_type)[0] for x in d) / n,
        "train/policy_kl_error": sum(ref_kl(-x, kl_type)[0] for x in d) / n,
        "train/min_seq_mult_prob_error": min(seq_mpe),
        "train/max_seq_mult_prob_error": max(seq_mpe),
        J + "k1_kl": sum(-x for x in d) / n,
        J + "chi2_token": sum(math.exp(2 * x) for x in d) / n - 1,
        J + "chi2_seq": sum(math.exp(2 * max(-50.0, min(50.0, sum(s)))) for s in seqs) / len(seqs)
        - 1,
    }


# ------------------------------------------------------------------------------ helpers


def T(rows):
    return torch.tensor(rows, dtype=torch.float64)


def run_ours(curr, prev, gen, adv, valid, seq_kept, cfg, ref=None, corr=None, **kw):
    c = T(curr).requires_grad_(True)
    loss_fn = {**cfg}
    for k in ("token_level_loss",):
        loss_fn.setdefault(k, True)
    config = GRPOLossConfig(
        **loss_fn, correction=corr or CorrectionConfig(token_level_loss=loss_fn["token_level_loss"])
    )
    loss, m = grpo_loss(
        c, T(prev), T(gen), T(adv), T(valid), T(seq_kept),
        reference_logprobs=None if ref is None else T(ref), config=config, **kw,
    )  # fmt: skip
    loss.backward()
    return loss.item(), c.grad, m


def assert_grad(ours: torch.Tensor, ref: list[list[float]]) -> None:
    torch.testing.assert_close(ours, T(ref), rtol=REL, atol=1e-15)


# Two sequences, A = +0.75 and -1.25. PPO ratios r = exp(curr - prev), clip range [0.9, 1.3]:
#   row 0 (A > 0): r = 1.25 (inside; outside if the bounds were swapped to [0.7, 1.1]),
#                  r = 1.45 (clipped to 1.3), r = 0.8 (below: the unclipped branch counts)
#   row 1 (A < 0): r = 0.85 (clipped up to 0.9: constant), r = 1.2 (inside), r = 4 (dual clip)
# Rollout mismatch rho = exp(prev - gen): 0.4 (tis raises it to 0.5), 1.2, 1, 2.5 (tis: 1.5), 1, 0.9
PREV = [[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]]
CURR = [
    [p + LN(r) for p, r in zip(row, rs, strict=True)]
    for row, rs in zip(PREV, [[1.25, 1.45, 0.8], [0.85, 1.2, 4.0]], strict=True)
]
GEN = [
    [p - LN(r) for p, r in zip(row, rs, strict=True)]
    for row, rs in zip(PREV, [[0.4, 1.2, 1.0], [2.5, 1.0, 0.9]], strict=True)
]
ADV = [0.75, -1.25]
VALID = [[1, 1, 1], [1, 1, 1]]
KEPT = [1, 1]
PPO = {"ratio_clip_min": 0.1, "ratio_clip_max": 0.3, "reference_policy_kl_penalty": 0.0}


# ------------------------------------------------------------------------------ the loss


@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("mode", ["none", "token", "tis", "icepop", "seq-mask-tis"])
def test_clipped_pg_with_is_matches_reference(mode, dual):
    cfg = {**PPO, "ratio_clip_c": dual}
    lo, hi = (0.5, 1.5) if mode != "seq-mask-tis" else (0.8, 1.1)
    corr = CorrectionConfig.for_mode(mode, ratio_max=hi, ratio_min=lo) if mode != "none" else None
    w = ref_weights(GEN, PREV, VALID, mode, lo, hi)
    loss, grad, m = run_ours(CURR, PREV, GEN, ADV, VALID, KEPT, cfg, corr=corr)
    r_loss, r_grad = ref_grpo(CURR, PREV, GEN, ADV, VALID, KEPT, cfg, weights=w)
    assert loss == pytest.approx(r_loss, rel=REL)
    assert_grad(grad, r_grad)
    assert m["train/probs_ratio_clamped_min"] == pytest.approx(0.9, rel=REL)
    assert m["train/probs_ratio_clamped_max"] == pytest.approx(1.3, rel=REL)


def test_worked_clipped_pg_numbers():
    # the reference itself, checked by hand on the no-IS case (token mean over 6):
    # row 0: r 1.25 -> -0.9375; 1.45 -> max(-1.0875, -0.975) = -0.975; 0.8 -> -0.6
    # row 1: 0.85 -> max(1.0625, 1.125) = 1.125; 1.2 -> 1.5; 4 -> 5 (dual clip 3: 3.75)
    loss, _ = ref_grpo(CURR, PREV, GEN, ADV, VALID, KEPT, PPO)
    assert loss == pytest.approx((-0.9375 - 0.975 - 0.6 + 1.125 + 1.5 + 5.0) / 6, rel=REL)
    loss, _ = ref_grpo(CURR, PREV, GEN, ADV, VALID, KEPT, {**PPO, "ratio_clip_c": 3.0})
    assert loss == pytest.approx((-0.9375 - 0.975 - 0.6 + 1.125 + 1.5 + 3.75) / 6, rel=REL)


def test_approx_entropy_matches_reference():
    _, _, m = run_ours(CURR, PREV, GEN, ADV, VALID, KEPT, PPO)
    toks = [(c, g) for cr, gr in zip(CURR, GEN, strict=True) for c, g in zip(cr, gr, strict=True)]
    ent = -sum(math.exp(c - g) * c for c, g in toks) / len(toks)
    assert ent > 0 and m["train/approx_entropy"] == pytest.approx(ent, rel=REL)


# x = ref - curr per token: 0.5, -1.5 (input-clamped at 1), 2.5 (clamped) / -0.3, 0.9, -2.0
REF = [
    [c + x for c, x in zip(row, xs, strict=True)]
    for row, xs in zip(CURR, [[0.5, -1.5, 2.5], [-0.3, 0.9, -2.0]], strict=True)
]


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
@pytest.mark.parametrize("clamps", [(1.0, 0.6), (None, None), (1.0, None)])
def test_kl_penalty_value_and_gradient_match_reference(kl_type, on_policy, clamps):
    cfg = {
        **PPO,
        "reference_policy_kl_penalty": 0.2,
        "reference_policy_kl_type": kl_type,
        "kl_input_clamp_value": clamps[0],
        "kl_output_clamp_value": clamps[1],
        "use_on_policy_kl_approximation": on_policy,
    }
    loss, grad, m = run_ours(CURR, PREV, GEN, ADV, VALID, KEPT, cfg, ref=REF)
    r_loss, r_grad = ref_grpo(CURR, PREV, GEN, ADV, VALID, KEPT, cfg, ref=REF)
    assert loss == pytest.approx(r_loss, rel=REL)
    assert_grad(grad, r_grad)
    no_kl, _ = ref_grpo(CURR, PREV, GEN, ADV, VALID, KEPT, PPO)
    assert m["train/kl_penalty"] == pytest.approx((r_loss - no_kl) / 0.2, rel=1e-10)


def test_kl_clamped_token_has_no_gradient_but_unclamped_has():
    # row 0 token 2: x = 2.5 > input clamp 1 -> K(1) * exp(c - sg(c)) with the weight detached:
    # its gradient is exactly the PPO part; without the detach it would gain 0.2 K(1) / 6.
    cfg = {**PPO, "reference_policy_kl_penalty": 0.2, "kl_input_clamp_value": 1.0}
    _, grad, _ = run_ours(CURR, PREV, GEN, ADV, VALID, KEPT, cfg, ref=REF)
    _, ppo_grad, _ = run_ours(CURR, PREV, GEN, ADV, VALID, KEPT, PPO)
    assert grad[0, 2].item() == pytest.approx(ppo_grad[0, 2].item(), rel=REL)
    x = 0.5  # row 0 token 0 is not clamped: -K'(x) + K(x) = -(e^x - 1) + e^x - x - 1 = -x
    assert (grad - ppo_grad)[0, 0].item() == pytest.approx(0.2 * -x / 6, rel=1e-10)


def test_sequence_mean_uses_global_valid_seqs():
    # token_level_loss false: mean over sequences of token means, divided by global_valid_seqs
    valid = [[1, 1, 0], [1, 1, 1]]
    cfg = {**PPO, "token_level_loss": False}
    for gseq in (None, 5.0):
        loss, grad, _ = run_ours(CURR, PREV, GEN, ADV, valid, KEPT, cfg, global_valid_seqs=gseq)
        r_loss, r_grad = ref_grpo(CURR, PREV, GEN, ADV, valid, KEPT, cfg, gseq=gseq)
        assert loss == pytest.approx(r_loss, rel=REL)
        assert_grad(grad, r_grad)
    l2, _ = ref_grpo(CURR, PREV, GEN, ADV, valid, KEPT, cfg)
    l5, _ = ref_grpo(CURR, PREV, GEN, ADV, valid, KEPT, cfg, gseq=5.0)
    assert l5 == pytest.approx(l2 * 2 / 5, rel=REL)


def test_global_valid_tokens_scales_the_token_mean():
    loss, grad, _ = run_ours(CURR, PREV, GEN, ADV, VALID, KEPT, PPO, global_valid_tokens=15.0)
    r_loss, r_grad = ref_grpo(CURR, PREV, GEN, ADV, VALID, KEPT, PPO, gtok=15.0)
    assert loss == pytest.approx(r_loss, rel=REL)
    assert_grad(grad, r_grad)


# ------------------------------------------------------------------------------ IS weights


def test_seq_mask_tis_uses_the_geometric_mean():
    # row 0 log-ratios ln 4, ln 0.25: geometric mean 1 (kept), arithmetic mean 2.125 (would drop)
    # row 1 log-ratios ln 1.5, ln 1.5: both means 1.5 -> dropped by [0.5, 1.2]
    gen = [[0.0, 0.0], [0.0, 0.0]]
    prev = [[LN(4.0), LN(0.25)], [LN(1.5), LN(1.5)]]
    valid = [[1, 1], [1, 1]]
    cfg = CorrectionConfig.for_mode("seq-mask-tis", ratio_max=1.2, ratio_min=0.5)
    r = importance_weights(T(gen), T(prev), T(valid), config=cfg)
    torch.testing.assert_close(
        r.weights, T(ref_weights(gen, prev, valid, "seq-mask-tis", 0.5, 1.2))
    )
    assert r.weights.tolist() == [[pytest.approx(4.0), pytest.approx(0.25)], [0.0, 0.0]]
    assert r.stats["train/is_oob_ratio"] == 0.5


def test_tis_lower_bound_is_applied():
    gen, prev, valid = [[0.0, 0.0, 0.0]], [[LN(0.2), LN(1.1), LN(3.0)]], [[1, 1, 1]]
    cfg = CorrectionConfig.for_mode("tis", ratio_max=2.0, ratio_min=0.5)
    r = importance_weights(T(gen), T(prev), T(valid), config=cfg)
    torch.testing.assert_close(r.weights, T([[0.5, 1.1, 2.0]]))
    torch.testing.assert_close(r.weights, T(ref_weights(gen, prev, valid, "tis", 0.5, 2.0)))


# ------------------------------------------------------------------------------ metrics

# d = p - g: row 0: 0.3, -0.1, 0.7 (does not cancel: k1_kl != 0, exp(d) != exp(|d|));
# row 1: 20, 25, 15 (sum 60 > the chi2_seq clamp 50); row 2 is padding-only
MG = [[-1.0, -2.0, -0.5], [-40.0, -30.0, -20.0], [0.0, 0.0, 0.0]]
MP = [[-0.7, -2.1, 0.2], [-20.0, -5.0, -5.0], [5.0, 5.0, 5.0]]
MV = [[1, 1, 1], [1, 1, 1], [0, 0, 0]]


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_mismatch_metrics_match_reference(kl_type):
    m = mismatch_metrics(T(MG), T(MP), T(MV), kl_type=kl_type)
    for key, want in ref_metrics(MG, MP, MV, kl_type).items():
        assert m[key] == pytest.approx(want, rel=REL), key
    # worked by hand: k1_kl = -(0.9 + 60) / 6; chi2_seq = (e^1.8 + e^100) / 2 - 1
    assert m[J + "k1_kl"] == pytest.approx(-60.9 / 6, rel=REL)
    assert m[J + "chi2_seq"] == pytest.approx((math.exp(1.8) + math.exp(100.0)) / 2 - 1, rel=REL)


def test_gen_and_policy_kl_follow_the_kl_type():
    # one token, d = p - g = 0.2: k1 gen = -0.2, policy = 0.2; k2 both 0.02;
    # k3 gen = e^0.2 - 1.2, policy = e^-0.2 - 0.8
    g, p, v = T([[-1.2]]), T([[-1.0]]), T([[1]])
    want = {
        "k1": (-0.2, 0.2),
        "k2": (0.02, 0.02),
        "k3": (math.exp(0.2) - 1.2, math.exp(-0.2) - 0.8),
    }
    for kl_type, (gen_kl, pol_kl) in want.items():
        m = mismatch_metrics(g, p, v, kl_type=kl_type)
        assert m["train/gen_kl_error"] == pytest.approx(gen_kl, rel=1e-12), kl_type
        assert m["train/policy_kl_error"] == pytest.approx(pol_kl, rel=1e-12), kl_type
        # grpo_loss reports the configured type, as NeMo-RL's ClippedPGLossFn does
        cfg = {**PPO, "reference_policy_kl_type": kl_type}
        _, _, lm = run_ours([[-1.0]], [[-1.0]], [[-1.2]], [1.0], [[1]], [1], cfg)
        assert lm["train/gen_kl_error"] == pytest.approx(gen_kl, rel=1e-12), kl_type
        assert lm["train/policy_kl_error"] == pytest.approx(pol_kl, rel=1e-12), kl_type
    with pytest.raises(ValueError, match="kl_type"):
        mismatch_metrics(g, p, v, kl_type="k4")


# ------------------------------------------------------------------------------ non-finite


@pytest.mark.parametrize(("g", "p"), [(-100.0, -900.0), (-900.0, -100.0)])
def test_huge_log_ratio_is_unusable_in_both_directions(g, p):
    # |d| = 800: exp(|d|) overflows float64 either way; the token is counted and left out
    m = mismatch_metrics(T([[-1.0, g]]), T([[-1.5, p]]), T([[1, 1]]))
    assert m[J + "nonfinite_tokens"] == 1.0 and m[J + "num_valid_tokens"] == 1.0
    assert m["train/token_mult_prob_error"] == pytest.approx(math.exp(0.5), rel=REL)
    assert m["train/max_seq_mult_prob_error"] == pytest.approx(math.exp(0.5), rel=REL)
    assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("bad", ["curr", "prev", "gen", "ref"])
def test_neg_inf_logprob_on_a_valid_token_is_dropped_with_finite_gradient(bad):
    # NeMo-RL masks a -inf curr logprob upstream (mask_out_neg_inf_logprobs); grpo_loss itself
    # drops the token: no value, gradient 0, still in the denominator, counted
    curr, prev, gen, ref = ([row[:] for row in x] for x in (CURR, PREV, GEN, REF))
    {"curr": curr, "prev": prev, "gen": gen, "ref": ref}[bad][0][1] = -math.inf
    cfg = {**PPO, "reference_policy_kl_penalty": 0.2}
    loss, grad, m = run_ours(curr, prev, gen, ADV, VALID, KEPT, cfg, ref=ref)
    assert math.isfinite(loss) and torch.isfinite(grad).all()
    assert grad[0, 1].item() == 0.0
    kept = [[1, 0, 1], [1, 1, 1]]
    r_loss, r_grad = ref_grpo(CURR, PREV, GEN, ADV, kept, KEPT, cfg, ref=REF, gtok=6)
    assert loss == pytest.approx(r_loss, rel=REL)
    assert_grad(grad, r_grad)
    assert m[J + "loss_dropped_tokens"] == 1.0
