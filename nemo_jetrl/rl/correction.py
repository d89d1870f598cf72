"""Importance-sampling (IS) correction for the rollout/training mismatch.

The rollout engine samples token t from pi_rollout, but the loss is an expectation under
pi_train. Re-weighting each token by the importance ratio

    rho_t = pi_train(t) / pi_rollout(t) = exp(prev_logprobs_t - generation_logprobs_t)

makes the estimate unbiased, at the price of variance when rho has a heavy tail. The variants
trade a little bias for much less variance (NeMo-RL's ``loss_fn`` keys and semantics):

  none          weights are 1: no correction (``use_importance_sampling_correction: false``).
  token IS      w_t = rho_t (``use_importance_sampling_correction: true``, no type).
  tis           w_t = clamp(rho_t, min, max); min defaults to 0 ("truncated IS").
  icepop        w_t = rho_t if min <= rho_t <= max else 0 (tokens outside are dropped).
  seq-mask-tis  a sequence s is dropped (all w_t = 0) when its geometric-mean ratio
                exp(mean_{t in s} log rho_t) is outside [min, max]; kept sequences keep the
                raw, un-truncated rho_t.
  sequence IS   (``sequence_level_importance_ratios: true``) one weight per sequence,
                w_s = exp(sum_{t in s} log rho_t), broadcast to its tokens; tis/icepop then act
                on w_s. NeMo-RL requires ``token_level_loss: false`` with it (GSPO-style).

A ratio that is NaN or +-Inf (a NaN logprob, an overflowing exp) gets weight 0 and is counted
in ``jetrl/mismatch/is_nonfinite_weights``; an IS weight must never carry a NaN into the
gradient. As in NeMo-RL, a non-finite log-ratio counts as 0 (ratio 1) inside seq-mask-tis's
geometric mean. Ratios are computed in float64; a weight that would overflow the output dtype
counts as non-finite. Weights at invalid positions (token_mask 0 or sample_mask 0) are 0.

Stats (docs/metrics.md): ``train/sampling_importance_ratio`` (mean weight after truncation, over
valid tokens, or valid sequences for sequence IS: NeMo-RL's definition, reported even when the
correction is off), ``train/is_oob_ratio`` (fraction of valid tokens, or sequences for
seq-mask-tis, outside [min, max]; only with a truncation type), and under ``jetrl/mismatch/``:
``is_nonfinite_weights`` (count), ``is_zeroed_frac`` (fraction of valid tokens whose final
weight is 0), ``is_weight_min``, ``is_weight_max``, ``is_weight_ess`` (of the weights used).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_jetrl.rl.metrics import JETRL_PREFIX, NEMO_RL_PREFIX, check_logprobs, valid_mask

#: NeMo-RL's truncated_importance_sampling_type values.
TIS_TYPES = ("tis", "icepop", "seq-mask-tis")
#: the loss_fn keys this module reads (all NeMo-RL keys, same meaning).
LOSS_FN_KEYS = (
    "use_importance_sampling_correction",
    "truncated_importance_sampling_type",
    "truncated_importance_sampling_ratio",
    "truncated_importance_sampling_ratio_min",
    "sequence_level_importance_ratios",
    "token_level_loss",
)
#: names accepted by `CorrectionConfig.for_mode`.
MODES = ("none", "token", "tis", "icepop", "seq-mask-tis", "sequence")


class CorrectionConfigError(ValueError):
    """Invalid importance-sampling settings; ``errors`` lists every problem, each naming its key."""

    #: what the errors are about (the message's first line); subclasses change it.
    what = "importance-sampling settings"

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__(f"invalid {self.what}:\n  - " + "\n  - ".join(self.errors))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _rule_errors(
    use: bool,
    tis_type: str | None,
    ratio: float | None,
    ratio_min: float | None,
    seq_level: bool,
    token_level_loss: bool,
    path: str,
) -> list[str]:
    """NeMo-RL's ClippedPGLossFn checks, as messages naming the key and the fix."""
    k = f"{path}." if path else ""
    errs: list[str] = []
    if seq_level and token_level_loss:
        errs.append(
            f"{k}sequence_level_importance_ratios=true needs {k}token_level_loss=false "
            "(sequence-level IS, e.g. GSPO, is mutually exclusive with token-level loss)"
        )
    if tis_type is None:
        if ratio is not None:
            # NeMo-RL accepts this at construction and raises "Invalid truncated importance
            # sampling type: None" at the first training step; we say it up front.
            errs.append(
                f"{k}truncated_importance_sampling_ratio={ratio} is set but "
                f"{k}truncated_importance_sampling_type is null: set the type to one of "
                f"{', '.join(TIS_TYPES)} or set the ratio to null"
            )
        return errs
    if not use:
        errs.append(
            f"{k}truncated_importance_sampling_type={tis_type!r} needs "
            f"{k}use_importance_sampling_correction=true"
        )
    if tis_type not in TIS_TYPES:
        errs.append(
            f"{k}truncated_importance_sampling_type must be one of {', '.join(TIS_TYPES)} "
            f"(or null), got {tis_type!r}"
        )
    if ratio is None or not ratio > 0:
        errs.append(
            f"{k}truncated_importance_sampling_ratio must be a positive number when "
            f"{k}truncated_importance_sampling_type is set, got {ratio}"
        )
    if ratio_min is not None and ratio is not None and ratio_min > ratio:
        errs.append(
            f"{k}truncated_importance_sampling_ratio_min ({ratio_min}) must be <= "
            f"{k}truncated_importance_sampling_ratio ({ratio})"
        )
    if tis_type in ("icepop", "seq-mask-tis") and ratio_min is None:
        errs.append(
            f"{k}truncated_importance_sampling_ratio_min must be set when "
            f"{k}truncated_importance_sampling_type is {tis_type!r}"
        )
    if tis_type == "seq-mask-tis" and seq_level:
        errs.append(
            f"{k}truncated_importance_sampling_type='seq-mask-tis' is incompatible with "
            f"{k}sequence_level_importance_ratios=true (it masks sequences but keeps token "
            "weights): set one of them off"
        )
    return errs


def validate_loss_fn_cfg(cfg: Mapping[str, Any], *, path: str = "loss_fn") -> list[str]:
    """All problems with the IS keys of a NeMo-RL ``loss_fn`` mapping (empty list: valid).

    Other keys are ignored (they belong to the rest of the loss). Each message names the full
    YAML key (``path`` + key) and what to change.
    """
    k = f"{path}." if path else ""
    errs: list[str] = []
    if not isinstance(cfg, Mapping):
        return [f"{path or 'loss_fn'} must be a mapping, got {type(cfg).__name__}"]
    vals: dict[str, Any] = {}
    for key, default in (
        ("use_importance_sampling_correction", False),
        ("sequence_level_importance_ratios", False),
        ("token_level_loss", True),
    ):
        v = cfg.get(key, default)
        if v is None:
            v = default
        if not isinstance(v, bool):
            errs.append(f"{k}{key} must be true or false, got {v!r}")
            v = default
        vals[key] = v
    t = cfg.get("truncated_importance_sampling_type")
    if t is not None and not isinstance(t, str):
        errs.append(
            f"{k}truncated_importance_sampling_type must be a string "
            f"({', '.join(TIS_TYPES)}) or null, got {t!r}"
        )
        t = None
    vals["truncated_importance_sampling_type"] = t
    for key in ("truncated_importance_sampling_ratio", "truncated_importance_sampling_ratio_min"):
        v = cfg.get(key)
        if v is not None and (not _is_number(v) or math.isnan(v)):
            errs.append(f"{k}{key} must be a number or null, got {v!r}")
            v = None
        vals[key] = None if v is None else float(v)
    if errs:
        return errs
    return _rule_errors(
        vals["use_importance_sampling_correction"],
        vals["truncated_importance_sampling_type"],
        vals["truncated_importance_sampling_ratio"],
        vals["truncated_importance_sampling_ratio_min"],
        vals["sequence_level_importance_ratios"],
        vals["token_level_loss"],
        path,
    )


@dataclass(frozen=True)
class CorrectionConfig:
    """Importance-sampling settings; field names are NeMo-RL's ``loss_fn`` keys.

    Construction validates with NeMo-RL's rules and raises `CorrectionConfigError` listing
    every problem.
    """

    #: apply the weights in the loss; when false the weights are 1 (stats are still reported).
    use_importance_sampling_correction: bool = False
    #: None (no truncation), "tis", "icepop" or "seq-mask-tis".
    truncated_importance_sampling_type: str | None = None
    #: upper bound of the ratio (required, > 0, when a type is set).
    truncated_importance_sampling_ratio: float | None = None
    #: lower bound; None means 0 for tis; required for icepop and seq-mask-tis.
    truncated_importance_sampling_ratio_min: float | None = None
    #: one weight per sequence, exp(sum of token log-ratios) (GSPO-style sequence IS).
    sequence_level_importance_ratios: bool = False
    #: NeMo-RL's loss aggregation flag; only checked here (sequence IS needs it false).
    token_level_loss: bool = True

    def __post_init__(self) -> None:
        errs = _rule_errors(
            self.use_importance_sampling_correction,
            self.truncated_importance_sampling_type,
            self.truncated_importance_sampling_ratio,
            self.truncated_importance_sampling_ratio_min,
            self.sequence_level_importance_ratios,
            self.token_level_loss,
            "",
        )
        if errs:
            raise CorrectionConfigError(errs)

    @classmethod
    def from_loss_fn_cfg(cls, cfg: Mapping[str, Any], *, path: str = "loss_fn") -> CorrectionConfig:
        """Build from a NeMo-RL ``loss_fn`` mapping (dict or OmegaConf); raise listing all errors."""
        if not isinstance(cfg, Mapping) and hasattr(cfg, "items"):
            cfg = dict(cfg.items())
        errs = validate_loss_fn_cfg(cfg, path=path)
        if errs:
            raise CorrectionConfigError(errs)
        kw: dict[str, Any] = {}
        for key in LOSS_FN_KEYS:
            v = cfg.get(key)
            if v is not None:
                kw[key] = float(v) if key.startswith("truncated_importance_sampling_ratio") else v
        return cls(**kw)

    @classmethod
    def for_mode(
        cls, mode: str, *, ratio_max: float | None = None, ratio_min: float | None = None
    ) -> CorrectionConfig:
        """Shorthand: mode in none | token | tis | icepop | seq-mask-tis | sequence.

        ``sequence`` is sequence IS (token_level_loss false), truncated with tis when
        ``ratio_max`` is given.
        """
        if mode not in MODES:
            raise CorrectionConfigError(
                [f"correction mode must be one of {', '.join(MODES)}, got {mode!r}"]
            )
        if mode == "none":
            return cls()
        if mode == "token":
            return cls(use_importance_sampling_correction=True)
        if mode == "sequence":
            return cls(
                use_importance_sampling_correction=True,
                sequence_level_importance_ratios=True,
                token_level_loss=False,
                truncated_importance_sampling_type="tis" if ratio_max is not None else None,
                truncated_importance_sampling_ratio=ratio_max,
                truncated_importance_sampling_ratio_min=ratio_min,
            )
        return cls(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type=mode,
            truncated_importance_sampling_ratio=ratio_max,
            truncated_importance_sampling_ratio_min=ratio_min,
        )

    @property
    def mode(self) -> str:
        """none | token | tis | icepop | seq-mask-tis | sequence (the latter possibly truncated)."""
        if not self.use_importance_sampling_correction:
            return "none"
        if self.sequence_level_importance_ratios:
            return "sequence"
        return self.truncated_importance_sampling_type or "token"

    def to_loss_fn_cfg(self) -> dict[str, Any]:
        """The NeMo-RL ``loss_fn`` keys for these settings."""
        return {key: getattr(self, key) for key in LOSS_FN_KEYS}


@dataclass(frozen=True)
class CorrectionResult:
    """Per-token weights for the loss and the stats of how they were formed."""

    #: [B, T] weights to multiply into the per-token loss (0 at invalid positions), detached.
    weights: torch.Tensor
    #: {tag: value}, see the module docstring.
    stats: dict[str, float] = field(default_factory=dict)


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
    least float32, 0 at invalid positions and for non-finite ratios.
    """
    shape = check_logprobs(generation_logprobs=generation_logprobs, prev_logprobs=prev_logprobs)
    mask = valid_mask(token_mask, sample_mask, shape)
    out_dtype = _out_dtype(prev_logprobs)
    big = torch.finfo(out_dtype).max
    d = prev_logprobs.detach().to(torch.float64) - generation_logprobs.detach().to(torch.float64)
    zero = torch.zeros_like(d)
    c = config
    seq_ok = (
        torch.ones(shape[0], dtype=torch.bool)
        if sample_mask is None
        else valid_mask(torch.ones(shape, dtype=torch.bool), sample_mask, shape)[:, 0]
    ).to(d.device)

    if c.sequence_level_importance_ratios:
        # one weight per sequence; padding never enters the sum (select, not multiply)
        w_seq = torch.exp(torch.where(mask, d, zero).sum(-1))
        bad_seq = ~torch.isfinite(w_seq) | (w_seq > big)
        w_seq = torch.where(bad_seq, torch.zeros_like(w_seq), w_seq)
        nonfinite = int((bad_seq & mask.any(-1)).sum())
        w = w_seq.unsqueeze(-1).expand(shape)
    else:
        w = torch.exp(d)
        bad = ~torch.isfinite(w) | (w > big)
        w = torch.where(bad, zero, w)
        nonfinite = int((bad & mask).sum())

    n_tok = int(mask.sum())
    stats: dict[str, float] = {}
    hi = c.truncated_importance_sampling_ratio
    lo = c.truncated_importance_sampling_ratio_min
    t = c.truncated_importance_sampling_type
    if t == "tis":
        lo_t = 0.0 if lo is None else lo
        oob = (w > hi) | (w < lo_t)
        stats[NEMO_RL_PREFIX + "is_oob_ratio"] = (
            float((oob & mask).sum()) / n_tok if n_tok else math.nan
        )
        w = w.clamp(lo_t, hi)
    elif t == "icepop":
        keep = (w >= lo) & (w <= hi)
        stats[NEMO_RL_PREFIX + "is_oob_ratio"] = (
            float((~keep & mask).sum()) / n_tok if n_tok else math.nan
        )
        w = torch.where(keep, w, zero)
    elif t == "seq-mask-tis":
        log_r = torch.where(mask & torch.isfinite(d), d, zero)
        cnt = mask.sum(-1)
        geo = torch.exp(log_r.sum(-1) / cnt.clamp(min=1))  # empty row: exp(0) = 1
        keep_seq = (geo >= lo) & (geo <= hi)
        n_seq = int(seq_ok.sum())
        stats[NEMO_RL_PREFIX + "is_oob_ratio"] = (
            float((~keep_seq & seq_ok).sum()) / n_seq if n_seq else math.nan
        )
        w = w * keep_seq.unsqueeze(-1).to(w.dtype)

    if c.sequence_level_importance_ratios:
        # every column of a row holds the row's weight; mean over the sequences kept by sample_mask
        ws = w[:, 0][seq_ok] if shape[1] else w.new_zeros(0)
        sir = float(ws.mean()) if ws.numel() else math.nan
    w = torch.where(mask, w, zero)
    if not c.sequence_level_importance_ratios:
        sir = float(w[mask].mean()) if n_tok else math.nan
    stats[NEMO_RL_PREFIX + "sampling_importance_ratio"] = sir

    used = w if c.use_importance_sampling_correction else mask.to(torch.float64)
    uv = used[mask]
    stats[JETRL_PREFIX + "is_nonfinite_weights"] = float(nonfinite)
    stats[JETRL_PREFIX + "is_zeroed_frac"] = float((uv == 0).sum()) / n_tok if n_tok else math.nan
    stats[JETRL_PREFIX + "is_weight_min"] = float(uv.min()) if n_tok else math.nan
    stats[JETRL_PREFIX + "is_weight_max"] = float(uv.max()) if n_tok else math.nan
    s2 = float((uv * uv).sum())
    stats[JETRL_PREFIX + "is_weight_ess"] = (
        float(uv.sum()) ** 2 / (n_tok * s2) if s2 > 0 else math.nan
    )
    return CorrectionResult(weights=used.to(out_dtype), stats=stats)
