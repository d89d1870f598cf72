"""Importance-sampling weights for the rollout/training mismatch (`importance_weights`).

The modes and their settings are `nemo_jetrl.rl.correction`'s (NeMo-RL's ``loss_fn`` keys).
Ratios are computed in float64 from d = prev - generation.

Unusable tokens (`nemo_jetrl.rl.metrics.usable_tokens`: a NaN/Inf logprob, or |d| > 300) and
ratios that overflow the output dtype get weight 0 in *every* mode, after truncation, and are
counted in ``jetrl/mismatch/is_nonfinite_weights`` (sequences for sequence IS: one unusable
token zeroes its sequence). NeMo-RL instead zeroes NaN/Inf weights *before* ``tis`` clamps, so
a broken token comes out with weight ``ratio_min``; we keep it at 0 because such a ratio
measures nothing, and a weight of ``ratio_min`` would put an unmeasured token back into the
gradient, while token IS, icepop and seq-mask-tis all drop it. As in NeMo-RL, an unusable
token counts as log-ratio 0 (ratio 1) inside seq-mask-tis's geometric mean. Weights at invalid
positions (token_mask 0 or sample_mask 0) are 0; weights are detached.

Stats (docs/metrics.md): ``train/sampling_importance_ratio`` (mean weight after truncation, over
valid tokens, or valid sequences for sequence IS: NeMo-RL's definition, reported even when the
correction is off), ``train/is_oob_ratio`` (fraction of valid tokens, or sequences for
seq-mask-tis, outside [min, max]; only with a truncation type), and under ``jetrl/mismatch/``:
``is_nonfinite_weights`` (count), ``is_zeroed_frac`` (fraction of valid tokens whose final
weight is 0), ``is_weight_min``, ``is_weight_max``, ``is_weight_ess`` (of the weights used).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from nemo_jetrl.rl.correction import CorrectionConfig
from nemo_jetrl.rl.metrics import (
    JETRL_PREFIX,
    NEMO_RL_PREFIX,
    check_logprobs,
    kept_samples,
    usable_tokens,
    valid_mask,
)


@dataclass(frozen=True)
class CorrectionResult:
    """Per-token weights for the loss and the stats of how they were formed."""

    weights: torch.Tensor
    """[B, T] weights to multiply into the per-token loss (0 at invalid positions), detached."""

    stats: dict[str, float] = field(default_factory=dict)
    """{tag: value}, see the module docstring."""


def _out_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def importance_weights(
    generation_logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor | None = None,
    *,
    config: CorrectionConfig,
) -> CorrectionResult:
    """IS weights [B, T] from (prev - generation) logprobs under ``config``, plus stats.

    Weights are detached (no gradient flows through them), in the input's dtype promoted to at
    least float32, 0 at invalid positions and for unusable tokens / overflowing ratios.
    """
    shape = check_logprobs(generation_logprobs=generation_logprobs, prev_logprobs=prev_logprobs)
    mask = valid_mask(token_mask, sample_mask, shape)
    usable = usable_tokens(generation_logprobs, prev_logprobs, mask)
    out_dtype = _out_dtype(prev_logprobs)
    d64 = prev_logprobs.detach().to(torch.float64) - generation_logprobs.detach().to(torch.float64)
    d = torch.where(usable, d64, torch.zeros_like(d64))  # unusable tokens: log-ratio 0
    c = config
    seq_ok = kept_samples(sample_mask, shape[0], d.device)

    big = torch.finfo(out_dtype).max
    if c.sequence_level_importance_ratios:
        # one weight per sequence; padding never enters the sum (select, not multiply)
        w_seq = torch.exp(torch.where(mask, d, torch.zeros_like(d)).sum(-1))
        bad_seq = (mask & ~usable).any(-1) | ~torch.isfinite(w_seq) | (w_seq > big)
        nonfinite = int((bad_seq & mask.any(-1)).sum())
        bad = bad_seq.unsqueeze(-1).expand(shape)
        w = w_seq.unsqueeze(-1).expand(shape)
    else:
        w = torch.exp(d)
        bad = (mask & ~usable) | (w > big)
        nonfinite = int((bad & mask).sum())
    w = torch.where(bad, torch.zeros_like(w), w)

    stats: dict[str, float] = {}
    w = _truncate(w, d, mask, seq_ok, c, stats)
    # after truncation, so tis's ratio_min cannot give an unusable token a weight
    w = torch.where(bad, torch.zeros_like(w), w)
    n_tok = int(mask.sum())
    if c.sequence_level_importance_ratios:
        # every column of a row holds the row's weight; mean over the sequences kept by sample_mask
        ws = w[:, 0][seq_ok] if shape[1] else w.new_zeros(0)
        sir = float(ws.mean()) if ws.numel() else math.nan
    w = torch.where(mask, w, torch.zeros_like(w))
    if not c.sequence_level_importance_ratios:
        sir = float(w[mask].mean()) if n_tok else math.nan
    stats[NEMO_RL_PREFIX + "sampling_importance_ratio"] = sir

    used = w if c.use_importance_sampling_correction else mask.to(torch.float64)
    stats[JETRL_PREFIX + "is_nonfinite_weights"] = float(nonfinite)
    stats.update(_weight_stats(used[mask]))
    return CorrectionResult(weights=used.to(out_dtype), stats=stats)


def _truncate(
    w: torch.Tensor,
    d: torch.Tensor,
    mask: torch.Tensor,
    seq_ok: torch.Tensor,
    c: CorrectionConfig,
    stats: dict[str, float],
) -> torch.Tensor:
    """Apply ``tis`` / ``icepop`` / ``seq-mask-tis`` to the raw weights; record is_oob_ratio."""
    hi = c.truncated_importance_sampling_ratio
    lo = c.truncated_importance_sampling_ratio_min
    t = c.truncated_importance_sampling_type
    n_tok = int(mask.sum())
    key = NEMO_RL_PREFIX + "is_oob_ratio"
    if t == "tis":
        lo_t = 0.0 if lo is None else lo
        oob = (w > hi) | (w < lo_t)
        stats[key] = float((oob & mask).sum()) / n_tok if n_tok else math.nan
        return w.clamp(lo_t, hi)
    if t == "icepop":
        keep = (w >= lo) & (w <= hi)
        stats[key] = float((~keep & mask).sum()) / n_tok if n_tok else math.nan
        return torch.where(keep, w, torch.zeros_like(w))
    if t == "seq-mask-tis":
        cnt = mask.sum(-1)
        log_r = torch.where(mask, d, torch.zeros_like(d))
        geo = torch.exp(log_r.sum(-1) / cnt.clamp(min=1))  # empty row: exp(0) = 1
        keep_seq = (geo >= lo) & (geo <= hi)
        n_seq = int(seq_ok.sum())
        stats[key] = float((~keep_seq & seq_ok).sum()) / n_seq if n_seq else math.nan
        return w * keep_seq.unsqueeze(-1).to(w.dtype)
    return w


def _weight_stats(uv: torch.Tensor) -> dict[str, float]:
    """is_zeroed_frac / is_weight_min / _max / _ess of the weights of the valid tokens."""
    n = uv.numel()
    s2 = float((uv * uv).sum())
    return {
        JETRL_PREFIX + "is_zeroed_frac": float((uv == 0).sum()) / n if n else math.nan,
        JETRL_PREFIX + "is_weight_min": float(uv.min()) if n else math.nan,
        JETRL_PREFIX + "is_weight_max": float(uv.max()) if n else math.nan,
        JETRL_PREFIX + "is_weight_ess": float(uv.sum()) ** 2 / (n * s2) if s2 > 0 else math.nan,
    }
