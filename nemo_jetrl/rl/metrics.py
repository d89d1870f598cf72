"""Train/rollout mismatch metrics: how far the rollout engine's policy is from the trainer's.

The rollout engine (vLLM) samples a response and reports, for every sampled token, its logprob
under the *rollout* policy: ``generation_logprobs`` (g). The trainer then scores the same tokens
with the *training* forward: ``prev_logprobs`` (p). In a truly on-policy FP8 flow both sides see
the same numbers and p == g up to GEMM accumulation order; with BF16-train + FP8-rollout they
drift apart, and the metrics below say by how much.

Everything is computed from the per-token log-ratio ``d = p - g`` (log of the importance ratio
``rho = pi_train / pi_rollout``) over the *valid* tokens only: ``token_mask * sample_mask``.
Padding, prompt tokens and dropped samples never enter a sum, and a padded position holding NaN or
-inf cannot leak in (we select, we do not multiply by the mask). A valid token is *unusable* when
p or g is NaN/Inf (e.g. a -inf logprob from a filtered token) or |d| > LOG_RATIO_LIMIT (300),
in either direction: exp(|d|), rho^2 and 1/rho^2 would overflow or mean nothing. Unusable tokens
are excluded from every statistic and counted in ``jetrl/mismatch/nonfinite_tokens``; the same
rule (`usable_tokens`) decides which tokens the IS correction and the GRPO loss use. All
arithmetic is float64 whatever the input dtype.

Names. Where NeMo-RL logs the same quantity, we use its exact tag (NeMo-RL's ClippedPGLossFn
returns ``token_mult_prob_error`` etc. and grpo.py logs them with prefix ``train/``). Everything
else lives under the one prefix ``jetrl/mismatch/``. docs/metrics.md has the full table.

NeMo-RL's metrics (same definitions; the two KLs use ``kl_type``, NeMo-RL's
``reference_policy_kl_type``, k3 by default; `kl_estimator` has the three formulas):
  token_mult_prob_error  mean_t exp(|p - g|)                     1.0 means identical
  gen_kl_error           mean_t K(d), d = p - g                  KL(P_gen || P_train)
                         k3: e^d - d - 1, k2: d^2 / 2, k1: -d
  policy_kl_error        mean_t K(-d)                            KL(P_train || P_gen)
  js_divergence_error    with log m = log((e^p + e^g)/2):
                         mean_t 0.5*[e^(p-m) - (p-m) - 1] + 0.5*[e^(g-m) - (g-m) - 1]
  {min,mean,max}_seq_mult_prob_error  per sequence s: mean_{t in s} exp(|p - g|), then the
                         min/mean/max over sequences with at least one valid token.
The ``train/`` means are over all valid tokens of the batch (NeMo-RL's global token mean).

Ours (``jetrl/mismatch/...``), all documented in docs/metrics.md:
  k1_kl                  mean_t (g - p): the plain (k1) estimate of KL(P_gen || P_train); it can
                         be negative on a finite sample, which k3 cannot.
  train_log_ppl          mean over sequences of the per-sequence mean of -p (log-perplexity).
  rollout_log_ppl        same with g.
  log_ppl_diff           mean over sequences of (train_log_ppl_s - rollout_log_ppl_s).
  log_ppl_abs_diff       mean over sequences of |train_log_ppl_s - rollout_log_ppl_s|.
  ppl_ratio              mean over sequences of exp(train_log_ppl_s - rollout_log_ppl_s).
  chi2_token             mean_t rho^2 - 1 (chi-square divergence of the token importance ratio,
                         the variance an IS correction would add).
  chi2_seq               mean_s (prod_t rho)^2 - 1, with sum_t d clamped to +-SEQ_LOG_RATIO_CLAMP.
  is_ratio_{mean,std,min,max}      of rho over valid tokens (std: population, ddof=0).
  is_ratio_frac_above / _below     fraction of valid tokens with rho > max / rho < min bound.
  is_ratio_ess           effective sample size of rho as a fraction: (sum rho)^2 / (n sum rho^2),
                         1.0 when all weights are equal, -> 1/n when one weight dominates.
  is_ratio_trunc_{mean,std,min,max,ess}  the same after truncation rho -> clamp(rho, min, max)
                         (what ``tis`` would use).
  num_valid_tokens, num_valid_seqs, nonfinite_tokens   counts.
A statistic with no valid token is NaN (never a silent 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# The prefixes and `metric_names()` (the tags `mismatch_metrics` returns) live, torch-free, in
# `nemo_jetrl.rl.metric_names`: `jetrl compare` needs them where torch is not installed.
from nemo_jetrl.rl.metric_names import JETRL_PREFIX, METRIC_NAMES, NEMO_RL_PREFIX
from nemo_jetrl.rl.metric_names import metric_names as metric_names

#: default importance-ratio bounds for the "fraction outside" and "after truncation" statistics.
DEFAULT_RATIO_BOUNDS = (0.5, 2.0)
#: |sum_t log rho| is clamped to this before exp(2*.) in chi2_seq, so one runaway sequence gives
#: a huge but finite number (e^100 ~ 2.7e43) instead of inf (float64 overflows at e^709).
SEQ_LOG_RATIO_CLAMP = 50.0
#: a valid token with |p - g| above this is unusable (see the module docstring): e^300 ~ 2e130,
#: so rho^2 and 1/rho^2 (e^600) and their sums over any batch stay finite in float64.
LOG_RATIO_LIMIT = 300.0


def _name(key: str) -> str:
    return NEMO_RL_PREFIX + key


def _ours(key: str) -> str:
    return JETRL_PREFIX + key


def valid_mask(
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor | None,
    shape: torch.Size | Sequence[int],
) -> torch.Tensor:
    """Bool [B, T] mask of tokens that count: token_mask and (if given) the sample's mask.

    Raises ValueError naming the tensor when a shape does not fit ``shape`` ([B, T]).
    """
    shape = tuple(shape)
    if len(shape) != 2:
        raise ValueError(f"logprobs must be 2-D [batch, tokens], got shape {list(shape)}")
    if tuple(token_mask.shape) != shape:
        raise ValueError(
            f"token_mask has shape {list(token_mask.shape)} but the logprobs have {list(shape)}; "
            "pass one 0/1 entry per token"
        )
    mask = token_mask.to(torch.bool) if token_mask.dtype == torch.bool else token_mask != 0
    if sample_mask is not None:
        if tuple(sample_mask.shape) != (shape[0],):
            raise ValueError(
                f"sample_mask has shape {list(sample_mask.shape)}; expected [{shape[0]}] "
                "(one 0/1 entry per sequence)"
            )
        keep = sample_mask.to(torch.bool) if sample_mask.dtype == torch.bool else sample_mask != 0
        mask = mask & keep.to(mask.device).unsqueeze(-1)
    return mask


def kept_samples(
    sample_mask: torch.Tensor | None, batch: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Bool [batch]: the sequences ``sample_mask`` keeps (all when None), checked as in
    `valid_mask`; defined for responses padded to zero tokens too."""
    ones = torch.ones((batch, 1), dtype=torch.bool, device=device)
    return valid_mask(ones, sample_mask, (batch, 1))[:, 0]


def check_logprobs(**tensors: torch.Tensor) -> torch.Size:
    """Check that the named logprob tensors are 2-D and share one shape; return it."""
    shape = None
    first = None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D [batch, tokens], got shape {list(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if shape is None:
            shape, first = t.shape, name
        elif t.shape != shape:
            raise ValueError(
                f"{name} has shape {list(t.shape)} but {first} has {list(shape)}; "
                "both must be [batch, tokens] over the same tokens"
            )
    assert shape is not None
    return shape


def _mean(x: torch.Tensor) -> float:
    return float(x.mean()) if x.numel() else math.nan


def _ratio_stats(rho: torch.Tensor, prefix: str) -> dict[str, float]:
    """mean/std/min/max/ess of a 1-D float64 tensor of positive weights."""
    if rho.numel() == 0:
        return {_ours(f"{prefix}_{k}"): math.nan for k in ("mean", "std", "min", "max", "ess")}
    s1 = rho.sum()
    s2 = (rho * rho).sum()
    ess = float(s1 * s1 / (rho.numel() * s2)) if s2 > 0 else math.nan
    return {
        _ours(f"{prefix}_mean"): float(rho.mean()),
        _ours(f"{prefix}_std"): float(rho.std(unbiased=False)),
        _ours(f"{prefix}_min"): float(rho.min()),
        _ours(f"{prefix}_max"): float(rho.max()),
        _ours(f"{prefix}_ess"): ess,
    }


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator term e^x - x - 1 (>= 0), for x = log(q/p) with samples from p."""
    return torch.expm1(log_ratio) - log_ratio


def kl_estimator(log_ratio: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-sample estimate of KL(p || q) from x = log(q/p), samples from p (Schulman 2020):
    k1 = -x, k2 = x^2 / 2, k3 = e^x - x - 1 (NeMo-RL's ``reference_policy_kl_type``)."""
    if kl_type == "k1":
        return -log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio * log_ratio
    if kl_type == "k3":
        return k3(log_ratio)
    raise ValueError(f"kl_type must be k1, k2 or k3, got {kl_type!r}")


def usable_tokens(
    generation_logprobs: torch.Tensor, prev_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Bool [B, T]: valid (``mask``) tokens whose g and p are finite and |p - g| <= LOG_RATIO_LIMIT.

    The one rule for which tokens the metrics, the IS correction and the loss may use; the rest
    of ``mask`` is counted as non-finite and left out (a bound in both directions, so d = -800
    is as unusable as d = +800).
    """
    g = generation_logprobs.detach().to(torch.float64)
    p = prev_logprobs.detach().to(torch.float64)
    ok = torch.isfinite(g) & torch.isfinite(p)
    return mask & ok & ((p - g).abs() <= LOG_RATIO_LIMIT)


def mismatch_metrics(
    generation_logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor | None = None,
    *,
    ratio_bounds: tuple[float, float] = DEFAULT_RATIO_BOUNDS,
    kl_type: str = "k3",
) -> dict[str, float]:
    """All train/rollout mismatch metrics of one batch, as {tag: float}.

    Args:
        generation_logprobs: [B, T] logprobs of the sampled tokens under the rollout policy.
        prev_logprobs: [B, T] logprobs of the same tokens under the training forward.
        token_mask: [B, T] 1 for tokens that count (response tokens), 0 for prompt/padding.
        sample_mask: optional [B], 0 drops a whole sequence.
        ratio_bounds: (min, max) of the importance ratio for the "fraction outside" and
            "after truncation" statistics (0 <= min <= max).
        kl_type: estimator of ``train/gen_kl_error`` and ``train/policy_kl_error`` (k1, k2, k3),
            NeMo-RL's ``reference_policy_kl_type``.

    Returns:
        {tag: value}. NeMo-RL's metrics under ``train/`` (its exact names), ours under
        ``jetrl/mismatch/``. Tags are complete: log them with an empty prefix.
    """
    shape = check_logprobs(generation_logprobs=generation_logprobs, prev_logprobs=prev_logprobs)
    lo, hi = _bounds(ratio_bounds)
    mask = valid_mask(token_mask, sample_mask, shape)
    g = generation_logprobs.detach().to(torch.float64)
    p = prev_logprobs.detach().to(torch.float64)
    d = p - g  # log rho
    ok = usable_tokens(g, p, mask)
    nonfinite = int((mask & ~ok).sum())

    out = _token_errors(d[ok], p[ok], g[ok], kl_type)
    out.update(_sequence_errors(d, p, g, ok))
    rho = torch.exp(d[ok])
    out.update(_is_ratio_metrics(rho, lo, hi))
    out.update({k: _mean(t) for k, t in _token_terms(d[ok], lo, hi).items()})
    out[_ours("num_valid_tokens")] = float(rho.numel())
    out[_ours("num_valid_seqs")] = float(ok.any(dim=-1).sum())
    out[_ours("nonfinite_tokens")] = float(nonfinite)
    # in `metric_names()`' order (docs, `jetrl compare`); a tag missing there would come last
    return {k: out.pop(k) for k in METRIC_NAMES} | out


def _bounds(ratio_bounds: tuple[float, float]) -> tuple[float, float]:
    lo, hi = (float(b) for b in ratio_bounds)
    if not (0.0 <= lo <= hi) or math.isnan(hi):
        raise ValueError(f"ratio_bounds must satisfy 0 <= min <= max, got {ratio_bounds}")
    return lo, hi


def _token_terms(d: torch.Tensor, lo: float, hi: float) -> dict[str, torch.Tensor]:
    """Per-token terms of the log-ratios ``d`` whose mean over the usable tokens is each
    `ADDITIVE_MEANS` statistic: the one home of their definitions (`mismatch_metrics` takes the
    means, `mismatch_token_sums` the sums)."""
    rho = torch.exp(d)
    return {
        _ours("k1_kl"): -d,
        _ours("chi2_token"): rho * rho - 1.0,
        _ours("is_ratio_mean"): rho,
        _ours("is_ratio_frac_above"): (rho > hi).to(d.dtype),
        _ours("is_ratio_frac_below"): (rho < lo).to(d.dtype),
        _ours("is_ratio_trunc_mean"): rho.clamp(lo, hi),
    }


#: the token-mean statistics that are a sum over usable tokens divided by their count, so sums
#: from any split of a batch add up to the batch's (NeMo-RL sums loss metrics over micro-batches).
ADDITIVE_MEANS = tuple(_token_terms(torch.zeros(0, dtype=torch.float64), 0.0, 0.0))
#: the counts that come with them: usable tokens (the divisor) and valid but unusable tokens.
TOKEN_COUNTS = (_ours("num_valid_tokens"), _ours("nonfinite_tokens"))


def mismatch_token_sums(
    generation_logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor | None = None,
    *,
    ratio_bounds: tuple[float, float] = DEFAULT_RATIO_BOUNDS,
) -> dict[str, float]:
    """Sums over the usable tokens of each `ADDITIVE_MEANS` statistic, and `TOKEN_COUNTS`.

    Same arguments, masks and usable-token rule as `mismatch_metrics`; a sum divided by
    ``num_valid_tokens`` is its token mean. Built for a loss called per micro-batch (or per
    packed sequence) on a GPU: no boolean indexing and one device-to-host copy in all, where
    `mismatch_metrics` reads ~30 scalars back one by one.
    """
    shape = check_logprobs(generation_logprobs=generation_logprobs, prev_logprobs=prev_logprobs)
    lo, hi = _bounds(ratio_bounds)
    mask = valid_mask(token_mask, sample_mask, shape)
    g = generation_logprobs.detach().to(torch.float64)
    p = prev_logprobs.detach().to(torch.float64)
    ok = usable_tokens(g, p, mask)
    d = p - g
    # selected, not multiplied by the mask: an unusable token's NaN / inf never reaches a sum
    sums = [torch.where(ok, t, 0.0).sum() for t in _token_terms(d, lo, hi).values()]
    counts = [ok.sum(), (mask & ~ok).sum()]
    values = torch.stack([*sums, *(c.to(torch.float64) for c in counts)]).tolist()
    return dict(zip(ADDITIVE_MEANS + TOKEN_COUNTS, values, strict=True))


def _token_errors(
    dv: torch.Tensor, pv: torch.Tensor, gv: torch.Tensor, kl_type: str
) -> dict[str, float]:
    """NeMo-RL's token-level errors (multiplicative prob error, gen / policy KL, JS divergence)
    from the valid tokens' log-ratios ``dv`` and logprobs ``pv``, ``gv`` (1-D, batch order)."""
    out: dict[str, float] = {}
    out[_name("token_mult_prob_error")] = _mean(torch.exp(dv.abs()))
    out[_name("gen_kl_error")] = _mean(kl_estimator(dv, kl_type))
    out[_name("policy_kl_error")] = _mean(kl_estimator(-dv, kl_type))
    log_m = torch.logaddexp(pv, gv) - math.log(2.0)
    out[_name("js_divergence_error")] = _mean(0.5 * k3(pv - log_m) + 0.5 * k3(gv - log_m))
    return out


def _sequence_errors(
    d: torch.Tensor, p: torch.Tensor, g: torch.Tensor, ok: torch.Tensor
) -> dict[str, float]:
    """Per-sequence statistics (per-row sums over the ``ok`` tokens of [B, T] log-ratios ``d``
    and logprobs ``p``, ``g``; rows without one are left out): NeMo-RL's min / mean / max
    sequence multiplicative prob error, then our log-perplexities and sequence chi-square
    divergence."""
    okf = ok.to(torch.float64)
    n_tok = okf.sum(dim=-1)
    has = n_tok > 0
    zero = torch.zeros_like(d)
    out: dict[str, float] = {}
    seq_mpe = torch.where(ok, torch.exp(d.abs()), zero).sum(-1)[has] / n_tok[has]
    out[_name("min_seq_mult_prob_error")] = float(seq_mpe.min()) if seq_mpe.numel() else math.nan
    out[_name("mean_seq_mult_prob_error")] = _mean(seq_mpe)
    out[_name("max_seq_mult_prob_error")] = float(seq_mpe.max()) if seq_mpe.numel() else math.nan

    train_lppl = -torch.where(ok, p, zero).sum(-1)[has] / n_tok[has]
    roll_lppl = -torch.where(ok, g, zero).sum(-1)[has] / n_tok[has]
    diff = train_lppl - roll_lppl
    out[_ours("train_log_ppl")] = _mean(train_lppl)
    out[_ours("rollout_log_ppl")] = _mean(roll_lppl)
    out[_ours("log_ppl_diff")] = _mean(diff)
    out[_ours("log_ppl_abs_diff")] = _mean(diff.abs())
    out[_ours("ppl_ratio")] = _mean(torch.exp(diff))

    seq_log = torch.where(ok, d, zero).sum(-1)[has].clamp(-SEQ_LOG_RATIO_CLAMP, SEQ_LOG_RATIO_CLAMP)
    out[_ours("chi2_seq")] = _mean(torch.exp(2.0 * seq_log)) - 1.0
    return out


def _is_ratio_metrics(rho: torch.Tensor, lo: float, hi: float) -> dict[str, float]:
    """Statistics of the valid tokens' importance ratios ``rho`` (1-D): as they are and after
    truncation to [lo, hi] (the fractions outside are `_token_terms`')."""
    out = _ratio_stats(rho, "is_ratio")
    out.update(_ratio_stats(rho.clamp(lo, hi), "is_ratio_trunc"))
    return out
