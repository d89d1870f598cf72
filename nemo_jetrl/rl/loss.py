"""GRPO loss with the rollout/training importance-sampling correction.

GRPO samples a group of G responses per prompt and scores each with a reward r. The advantage
of a response is how much better it did than its group:

    A_i = r_i - b_i,   b_i = mean of the group's rewards (leave-one-out: of the *other* G-1)
    if normalize_rewards and std_i > 0:  A_i = A_i / (std_i + 1e-6)

where std_i is the unbiased (n-1) standard deviation of the same rewards the baseline used.
Groups of one response, and groups whose rewards are all equal, give A = 0 / are not sharpened.
This is NeMo-RL's GRPOAdvantageEstimator (``grpo.normalize_rewards``,
``grpo.use_leave_one_out_baseline``, both true by default there).

Every token t of response i carries A_i. With the PPO ratio r_t = pi_theta(t) / pi_old(t)
(pi_old = ``prev_logprobs``, the trainer's logprobs before this update):

    clip_loss_t = max(-A r_t, -A clip(r_t, 1 - ratio_clip_min, 1 + ratio_clip_max))
    dual clip (ratio_clip_c = c > 1, only where A < 0):  clip_loss_t = min(clip_loss_t, -A c)

The importance weight w_t of `nemo_jetrl.rl.correction` re-weights each token for the rollout/train
mismatch (w = 1 when the correction is off). The optional KL penalty to a frozen reference policy
uses the k3 estimator (k1/k2 available) on x = ref - curr, optionally clamped:

    kl_t = e^x - x - 1,   penalty = reference_policy_kl_penalty * mean(kl_t)

and, like NeMo-RL, multiplies kl_t by exp(curr - sg(curr)) (value 1) so its gradient includes
the score-function term of sampling from the current policy (or exp(curr - gen) with
``use_on_policy_kl_approximation``). Aggregation is NeMo-RL's token mean over the *global* batch:

    loss = sum_{valid t} w_t clip_loss_t / global_valid_tokens + beta * sum kl_t / global_valid_tokens

so summing the losses of micro-batches gives the batch's token mean (pass ``global_valid_tokens``;
by default it is this call's own valid-token count). With ``token_level_loss: false`` (needed for
sequence-level IS) each sequence is first averaged over its tokens and the loss is the mean over
sequences (``global_valid_seqs``); the PPO ratio then is per sequence too,
r_s = exp(mean_t (curr - prev)) (GSPO).

Padding never enters: invalid positions are replaced by 0 before any arithmetic, so NaN/-inf in
padding cannot poison the loss or its gradient. A valid token whose logprobs cannot be used
(curr, prev, generation or, with the KL penalty, reference logprob NaN/Inf, or |prev - gen| > 300:
`nemo_jetrl.rl.metrics.usable_tokens`) is dropped the same way: it adds 0 to the loss and gets
gradient 0, stays in the denominators (as in NeMo-RL, whose ``mask_out_neg_inf_logprobs`` sets a
-inf curr/prev logprob to 0 so the token adds a constant), and is counted in
``jetrl/mismatch/loss_dropped_tokens``. The returned metrics use NeMo-RL's names
(``train/loss``, ``train/probs_ratio``...), plus the correction stats; see docs/metrics.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

import torch

from nemo_jetrl.rl.loss_config import KL_TYPES, GRPOLossConfig, LossConfigError
from nemo_jetrl.rl.metrics import (
    JETRL_PREFIX,
    NEMO_RL_PREFIX,
    check_logprobs,
    kept_samples,
    kl_estimator,
    mismatch_metrics,
    usable_tokens,
    valid_mask,
)
from nemo_jetrl.rl.weights import CorrectionResult, importance_weights

# The settings live in `nemo_jetrl.rl.loss_config`; importing them from here keeps working.
__all__ = [
    "KL_TYPES",
    "GRPOLossConfig",
    "LossConfigError",
    "group_advantages",
    "grpo_loss",
]


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: torch.Tensor | Sequence[Hashable],
    *,
    normalize_rewards: bool = True,
    leave_one_out_baseline: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Per-response GRPO advantages [B] (float64) from rewards [B] and group (prompt) ids [B].

    See the module docstring for the formula; it matches NeMo-RL's GRPOAdvantageEstimator.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64).detach().flatten()
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != r.numel():
        raise ValueError(
            f"group_ids has {len(ids)} entries but rewards has {r.numel()}: one group id per response"
        )
    if not torch.isfinite(r).all():
        bad = torch.nonzero(~torch.isfinite(r)).flatten().tolist()
        raise ValueError(f"rewards must be finite; non-finite at indices {bad[:10]}")
    groups: dict[Hashable, list[int]] = {}
    for i, g in enumerate(ids):
        key = tuple(g) if isinstance(g, list) else g
        groups.setdefault(key, []).append(i)
    adv = torch.zeros_like(r)
    for idx in groups.values():
        n = len(idx)
        if n <= 1:
            continue  # no one to compare with: advantage 0
        v = r[idx]
        # M[i, j] = 1 when response j is in i's baseline
        m = (
            1.0 - torch.eye(n, dtype=torch.float64)
            if leave_one_out_baseline
            else torch.ones(n, n, dtype=torch.float64)
        )
        cnt = m.sum(-1)
        base = (m @ v) / cnt
        a = v - base
        if normalize_rewards:
            dev2 = m * (v.unsqueeze(0) - base.unsqueeze(1)) ** 2  # two-pass: stable
            var = torch.where(cnt > 1, dev2.sum(-1) / (cnt - 1).clamp(min=1), torch.zeros_like(cnt))
            std = var.sqrt()
            a = torch.where(std > 0, a / (std + epsilon), a)
        adv[idx] = a
    return adv


def grpo_loss(
    curr_logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor | None = None,
    *,
    reference_logprobs: torch.Tensor | None = None,
    config: GRPOLossConfig | None = None,
    global_valid_tokens: float | None = None,
    global_valid_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss of one (micro-)batch and its metrics.

    Args:
        curr_logprobs: [B, T] logprobs of the sampled tokens under the policy being optimised
            (carries the gradient).
        prev_logprobs: [B, T] trainer logprobs before the update (pi_old; the PPO ratio's base).
        generation_logprobs: [B, T] rollout engine logprobs (the IS correction's base).
        advantages: [B] (per response, e.g. from `group_advantages`) or [B, T].
        token_mask: [B, T] 1 for response tokens that count.
        sample_mask: optional [B]; 0 drops a response (None: every response kept, an empty one
            too: it counts as a sequence adding 0, as NeMo-RL counts it).
        reference_logprobs: [B, T] reference-policy logprobs; required when
            config.reference_policy_kl_penalty != 0.
        config: loss settings (defaults: NeMo-RL's).
        global_valid_tokens / global_valid_seqs: denominators of the token / sequence mean over
            the whole batch when this call sees one micro-batch (at least this call's counts,
            ValueError otherwise; 0 gives a zero loss); default: this call's counts.

    Returns:
        (loss, metrics): scalar loss tensor in curr_logprobs' dtype, and {tag: float} with
        NeMo-RL's loss metric names under ``train/`` plus the correction stats.
    """
    cfg = config or GRPOLossConfig()
    beta = float(cfg.reference_policy_kl_penalty)
    logprobs = (curr_logprobs, prev_logprobs, generation_logprobs)
    raw = (generation_logprobs, prev_logprobs, token_mask, sample_mask)
    shape, mask, adv = _checked_inputs(
        *logprobs, advantages, token_mask, sample_mask, reference_logprobs, beta
    )
    ref_in = reference_logprobs if beta != 0.0 else None
    use, (curr, prev, gen, adv), ref = _usable_cleaned(logprobs, ref_in, adv, mask)
    dt = curr_logprobs.dtype
    aggregate, _, n_seq = _aggregator(
        mask, use, sample_mask, dt, cfg.token_level_loss, global_valid_tokens, global_valid_seqs
    )
    ratios, clamped, clip_loss = _clipped_loss(curr, prev, adv, use.to(dt), shape, cfg)
    corr = importance_weights(*raw, config=cfg.correction)
    w = corr.weights.to(dt)
    actor_loss = aggregate(w * clip_loss)
    kl_mean = None if ref is None else aggregate(_kl_per_token(curr, gen, ref, cfg))
    loss = actor_loss if kl_mean is None else actor_loss + beta * kl_mean
    with torch.no_grad():
        metrics = _loss_metrics(
            (loss, kl_mean), (ratios, clamped), (curr, gen), (mask, use), n_seq, raw, corr, cfg
        )
    return loss, metrics


# -- phases of grpo_loss -----------------------------------------------------------------------


def _checked_inputs(
    curr_logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor | None,
    reference_logprobs: torch.Tensor | None,
    beta: float,
) -> tuple[torch.Size, torch.Tensor, torch.Tensor]:
    """(shape [B, T], valid-token mask, advantages broadcast to [B, T]); ValueError when the
    inputs disagree or the KL penalty lacks its reference logprobs."""
    tensors = {
        "curr_logprobs": curr_logprobs,
        "prev_logprobs": prev_logprobs,
        "generation_logprobs": generation_logprobs,
    }
    if beta != 0.0:
        if reference_logprobs is None:
            raise ValueError(
                "reference_logprobs is required when loss_fn.reference_policy_kl_penalty != 0 "
                f"(it is {beta}); pass the reference policy's logprobs or set the penalty to 0"
            )
        tensors["reference_logprobs"] = reference_logprobs
    shape = check_logprobs(**tensors)
    mask = valid_mask(token_mask, sample_mask, shape)
    dt = curr_logprobs.dtype
    if advantages.shape == (shape[0],):
        adv = advantages.to(dt).unsqueeze(-1).expand(shape)
    elif tuple(advantages.shape) == tuple(shape):
        adv = advantages.to(dt)
    else:
        raise ValueError(
            f"advantages has shape {list(advantages.shape)}; expected [{shape[0]}] (one per "
            f"response) or {list(shape)} (one per token)"
        )
    return shape, mask, adv


def _usable_cleaned(
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    reference_logprobs: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None]:
    """(use, (curr, prev, gen, adv), ref): ``use`` marks the valid tokens whose logprobs can be
    used (`usable_tokens`, finite curr and, with the KL penalty, finite reference); the inputs
    come back in curr's dtype with every other position 0, all but curr detached. ``logprobs``:
    (curr, prev, generation); ``reference_logprobs``: None without the KL penalty."""
    curr_logprobs, prev_logprobs, generation_logprobs = logprobs
    dt = curr_logprobs.dtype
    zero = torch.zeros((), dtype=dt, device=curr_logprobs.device)
    use = usable_tokens(generation_logprobs, prev_logprobs, mask) & torch.isfinite(
        curr_logprobs.detach()
    )
    if reference_logprobs is not None:
        use &= torch.isfinite(reference_logprobs.detach())

    def clean(t: torch.Tensor) -> torch.Tensor:
        # select, not multiply: a dropped -inf/NaN gets neither a value nor a gradient
        return torch.where(use, t.to(dt), zero)

    detached = (clean(t.detach()) for t in (prev_logprobs, generation_logprobs, adv))
    ref = None if reference_logprobs is None else clean(reference_logprobs.detach())
    return use, (clean(curr_logprobs), *detached), ref


def _aggregator(
    mask: torch.Tensor,
    use: torch.Tensor,
    sample_mask: torch.Tensor | None,
    dt: torch.dtype,
    token_level_loss: bool,
    global_valid_tokens: float | None,
    global_valid_seqs: float | None,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], float, float]:
    """(aggregate, valid tokens, valid sequences): ``aggregate`` turns a per-token loss into the
    global token mean, or the mean over sequences of token means (``token_level_loss: false``).
    Only ``use`` tokens add to the sums; every valid (``mask``) token counts in the means."""
    maskf, usef = mask.to(dt), use.to(dt)
    n_tok = float(mask.sum())
    # every response counts as a sequence unless its sample_mask drops it (NeMo-RL's
    # global_valid_seqs = sum(sample_mask)), an empty one too: it adds 0 to the mean
    if sample_mask is None:
        seq_ok = torch.ones(len(mask), dtype=torch.bool, device=mask.device)
    else:
        seq_ok = kept_samples(sample_mask, len(mask), mask.device)
    n_seq = float(seq_ok.sum())
    tok_den = float(global_valid_tokens) if global_valid_tokens is not None else max(n_tok, 1.0)
    seq_den = float(global_valid_seqs) if global_valid_seqs is not None else max(n_seq, 1.0)
    tok_den = _divisor(tok_den, n_tok, "global_valid_tokens")
    seq_den = _divisor(seq_den, n_seq, "global_valid_seqs")

    def aggregate(per_token: torch.Tensor) -> torch.Tensor:
        if token_level_loss:
            return (per_token * usef).sum() / tok_den
        cnt = maskf.sum(-1).clamp(min=1.0)
        per_seq = (per_token * usef).sum(-1) / cnt
        return (per_seq * seq_ok.to(dt)).sum() / seq_den

    return aggregate, n_tok, n_seq


def _divisor(den: float, local: float, name: str) -> float:
    """A mean's divisor: a global count must cover this call's ``local`` one (ValueError
    otherwise); 0 (nothing valid anywhere, so every summed term is 0) divides by 1, not 0."""
    if not local <= den < math.inf:
        raise ValueError(f"{name}={den} must be finite and >= this call's own count {local:g}")
    return den if den > 0 else 1.0


def _clipped_loss(
    curr: torch.Tensor,
    prev: torch.Tensor,
    adv: torch.Tensor,
    maskf: torch.Tensor,
    shape: torch.Size,
    cfg: GRPOLossConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ratios, clamped ratios, per-token clipped PG loss): the PPO ratio per token, or per
    sequence with GSPO (``sequence_level_importance_ratios``), clipped and dual-clipped."""
    log_ratio = curr - prev
    if cfg.correction.sequence_level_importance_ratios:
        cnt = maskf.sum(-1, keepdim=True).clamp(min=1.0)
        ratios = torch.exp((log_ratio * maskf).sum(-1, keepdim=True) / cnt).expand(shape)
    else:
        ratios = torch.exp(log_ratio)
    ratios_clamped = ratios.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
    clip_loss = torch.maximum(-adv * ratios, -adv * ratios_clamped)
    if cfg.ratio_clip_c is not None:
        clip_loss = torch.where(
            adv < 0, torch.minimum(clip_loss, -adv * cfg.ratio_clip_c), clip_loss
        )
    return ratios, ratios_clamped, clip_loss


def _kl_per_token(
    curr: torch.Tensor, gen: torch.Tensor, ref: torch.Tensor, cfg: GRPOLossConfig
) -> torch.Tensor:
    """Per-token KL to the reference policy: the estimator on the (clamped) x = ref - curr,
    weighted by exp(curr - sg(curr)) (or exp(curr - gen)), output-clamped."""
    x = ref - curr
    kl_w = (
        torch.exp(curr - gen)
        if cfg.use_on_policy_kl_approximation
        else torch.exp(curr - curr.detach())
    )
    kl_w = torch.nan_to_num(kl_w, nan=0.0, posinf=0.0, neginf=0.0)
    if cfg.kl_input_clamp_value is not None:
        c = cfg.kl_input_clamp_value
        xc = x.clamp(-c, c)
        kl_w = torch.where(x == xc, kl_w, kl_w.detach())  # clamped: no gradient through it
        x = xc
    kl = kl_estimator(x, cfg.reference_policy_kl_type) * kl_w
    if cfg.kl_output_clamp_value is not None:
        kl = kl.clamp(-cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
    return kl


def _loss_metrics(
    losses: tuple[torch.Tensor, torch.Tensor | None],
    ratio_pair: tuple[torch.Tensor, torch.Tensor],
    logprobs: tuple[torch.Tensor, torch.Tensor],
    masks: tuple[torch.Tensor, torch.Tensor],
    n_seq: float,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    corr: CorrectionResult,
    cfg: GRPOLossConfig,
) -> dict[str, float]:
    """NeMo-RL's loss metrics (``train/...``) of ``losses`` (loss, KL mean or None),
    ``ratio_pair`` (PPO ratios, clamped) and the cleaned ``logprobs`` (curr, gen) over the tokens
    the loss used (``masks``: valid, used), the mismatch errors of ``inputs`` (generation, prev
    logprobs, token mask, sample mask) with NeMo-RL's ``reference_policy_kl_type``, and the
    correction stats; call under no_grad."""
    (loss, kl_mean), (ratios, ratios_clamped), (curr, gen) = losses, ratio_pair, logprobs
    mask, sel = masks
    n_tok = int(sel.sum())
    r_v = ratios.detach()[sel].double()
    rc_v = ratios_clamped.detach()[sel].double()
    c64, g64 = curr.detach().double(), gen.double()
    p = NEMO_RL_PREFIX
    metrics: dict[str, float] = {
        p + "loss": float(loss.detach()),
        p + "probs_ratio": float(r_v.mean()) if n_tok else math.nan,
        p + "probs_ratio_clamped": float(rc_v.mean()) if n_tok else math.nan,
        p + "probs_ratio_min": float(r_v.min()) if n_tok else math.nan,
        p + "probs_ratio_max": float(r_v.max()) if n_tok else math.nan,
        p + "probs_ratio_clamped_min": float(rc_v.min()) if n_tok else math.nan,
        p + "probs_ratio_clamped_max": float(rc_v.max()) if n_tok else math.nan,
        p + "kl_penalty": float(kl_mean.detach()) if kl_mean is not None else 0.0,
        p + "approx_entropy": float(-(torch.exp(c64 - g64) * c64)[sel].mean())
        if n_tok
        else math.nan,
        p + "num_valid_samples": n_seq,
        JETRL_PREFIX + "loss_dropped_tokens": float((mask & ~sel).sum()),
    }
    mm = mismatch_metrics(*inputs, kl_type=cfg.reference_policy_kl_type)
    for key in (
        "token_mult_prob_error",
        "gen_kl_error",
        "policy_kl_error",
        "js_divergence_error",
    ):
        metrics[p + key] = mm[p + key]
    metrics.update(corr.stats)
    return metrics
