"""Importance-sampling (IS) correction settings and their rules (``loss_fn`` keys).

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

This module holds the settings (`CorrectionConfig`) and the one copy of NeMo-RL's rules for
them (`loss_fn_issues`; `nemo_jetrl.config.validate` calls it too). It does not import torch,
so config validation stays light; the weights themselves are `nemo_jetrl.rl.weights`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class LossFnIssue:
    """One problem with the IS keys of ``loss_fn``; `nemo_jetrl.config.validate` reports these
    as ConfigIssues, `validate_loss_fn_cfg` as ``"<key> <message>"`` strings."""

    key: str
    """full YAML key, e.g. ``loss_fn.truncated_importance_sampling_ratio``."""

    message: str
    """what is wrong and what to change; reads on after the key."""

    allowed: tuple[Any, ...] = ()
    """the values the key accepts, when it is an enumeration."""

    def __str__(self) -> str:
        return f"{self.key} {self.message}"


def _tis_keys(k: str) -> tuple[str, str, str]:
    """The keys of the truncated-IS type, ratio and ratio_min under the prefix ``k``."""
    return (
        f"{k}truncated_importance_sampling_type",
        f"{k}truncated_importance_sampling_ratio",
        f"{k}truncated_importance_sampling_ratio_min",
    )


def _rule_issues(
    use: bool,
    tis_type: str | None,
    ratio: float | None,
    ratio_min: float | None,
    seq_level: bool,
    token_level_loss: bool,
    path: str,
) -> list[LossFnIssue]:
    """NeMo-RL's ClippedPGLossFn checks, each naming its key and the fix."""
    k = f"{path}." if path else ""
    typ, rat, _ = _tis_keys(k)
    out: list[LossFnIssue] = []
    if seq_level and token_level_loss:
        out.append(
            LossFnIssue(
                f"{k}sequence_level_importance_ratios",
                f"is true, which needs {k}token_level_loss=false (sequence-level IS, e.g. GSPO, "
                "is mutually exclusive with token-level loss)",
            )
        )
    if tis_type is None:
        if ratio is not None:
            # NeMo-RL accepts this at construction and raises "Invalid truncated importance
            # sampling type: None" at the first training step; we say it up front.
            out.append(
                LossFnIssue(
                    rat,
                    f"is set ({ratio}) but {typ} is null: set the type to one of "
                    f"{', '.join(TIS_TYPES)} or set the ratio to null",
                )
            )
        return out
    return out + _truncation_issues(use, tis_type, ratio, ratio_min, seq_level, k)


def _truncation_issues(
    use: bool,
    tis_type: str,
    ratio: float | None,
    ratio_min: float | None,
    seq_level: bool,
    k: str,
) -> list[LossFnIssue]:
    """NeMo-RL's checks of a set truncated_importance_sampling_type (keys under the prefix
    ``k``): it needs the correction on, a known type, a positive ratio above ratio_min, a
    ratio_min for the masking types, and seq-mask-tis excludes sequence-level ratios."""
    typ, rat, rmin = _tis_keys(k)
    out: list[LossFnIssue] = []
    if not use:
        out.append(
            LossFnIssue(
                typ,
                f"is {tis_type!r}, which truncates importance weights and needs "
                f"{k}use_importance_sampling_correction=true: enable it or set the type to null",
            )
        )
    if tis_type not in TIS_TYPES:
        out.append(
            LossFnIssue(
                typ,
                f"unknown value {tis_type!r}: must be one of {', '.join(TIS_TYPES)} (or null)",
                (*TIS_TYPES, None),
            )
        )
    if ratio is None or not ratio > 0:
        out.append(LossFnIssue(rat, f"must be a positive number when {typ} is set, got {ratio}"))
    if ratio_min is not None and ratio is not None and ratio_min > ratio:
        out.append(LossFnIssue(rmin, f"({ratio_min}) must be <= {rat} ({ratio})"))
    if tis_type in ("icepop", "seq-mask-tis") and ratio_min is None:
        out.append(
            LossFnIssue(
                rmin,
                f"must be set when {typ} is {tis_type!r} (it drops tokens/sequences whose "
                "weight is outside [min, max]): set a lower bound, e.g. 0.5",
            )
        )
    if tis_type == "seq-mask-tis" and seq_level:
        out.append(
            LossFnIssue(
                f"{k}sequence_level_importance_ratios",
                f"is true, which is incompatible with {typ}='seq-mask-tis' (it masks sequences "
                "but keeps token weights): set one of them off",
            )
        )
    return out


def loss_fn_issues(cfg: Mapping[str, Any], *, path: str = "loss_fn") -> list[LossFnIssue]:
    """All problems of a NeMo-RL ``loss_fn`` mapping (empty list: valid): each key's type and
    range (the typed schema, `nemo_jetrl.config.nemo_rl_model.LossFn`), then, on well-typed
    values, the IS rules across keys (their one home; `CorrectionConfig` and
    `nemo_jetrl.config.validate` call it). Keys NeMo-RL has and we do not read pass.
    """
    from nemo_jetrl.config.nemo_rl_model import LossFn  # each key's type: the typed schema
    from nemo_jetrl.config.typed import parse_rest, plain

    data = plain(cfg)
    model, found = parse_rest(LossFn, data, path)
    out = [LossFnIssue(i.path, i.message, i.allowed) for i in found]
    k = f"{path}." if path else ""
    if model is None or {i.path.removeprefix(k) for i in found} & set(LOSS_FN_KEYS):
        return out  # the IS rules run on well-typed IS keys only

    def flag(key: str, default: bool) -> bool:
        v = getattr(model, key)
        return default if v is None else v

    return out + _rule_issues(
        flag("use_importance_sampling_correction", False),
        model.truncated_importance_sampling_type,
        model.truncated_importance_sampling_ratio,
        model.truncated_importance_sampling_ratio_min,
        flag("sequence_level_importance_ratios", False),
        flag("token_level_loss", True),
        path,
    )


def validate_loss_fn_cfg(cfg: Mapping[str, Any], *, path: str = "loss_fn") -> list[str]:
    """`loss_fn_issues` as ``"<key> <message>"`` strings (empty list: valid)."""
    return [str(i) for i in loss_fn_issues(cfg, path=path)]


@dataclass(frozen=True)
class CorrectionConfig:
    """Importance-sampling settings; field names are NeMo-RL's ``loss_fn`` keys.

    Construction validates with NeMo-RL's rules and raises `CorrectionConfigError` listing
    every problem.
    """

    use_importance_sampling_correction: bool = False
    """apply the weights in the loss; when false the weights are 1 (stats are still reported)."""

    truncated_importance_sampling_type: str | None = None
    """None (no truncation), "tis", "icepop" or "seq-mask-tis"."""

    truncated_importance_sampling_ratio: float | None = None
    """upper bound of the ratio (required, > 0, when a type is set)."""

    truncated_importance_sampling_ratio_min: float | None = None
    """lower bound; None means 0 for tis; required for icepop and seq-mask-tis."""

    sequence_level_importance_ratios: bool = False
    """one weight per sequence, exp(sum of token log-ratios) (GSPO-style sequence IS)."""

    token_level_loss: bool = True
    """NeMo-RL's loss aggregation flag; only checked here (sequence IS needs it false)."""

    def __post_init__(self) -> None:
        errs = _rule_issues(
            self.use_importance_sampling_correction,
            self.truncated_importance_sampling_type,
            self.truncated_importance_sampling_ratio,
            self.truncated_importance_sampling_ratio_min,
            self.sequence_level_importance_ratios,
            self.token_level_loss,
            "",
        )
        if errs:
            raise CorrectionConfigError([str(e) for e in errs])

    @classmethod
    def from_loss_fn_cfg(cls, cfg: Mapping[str, Any], *, path: str = "loss_fn") -> CorrectionConfig:
        """Build from a NeMo-RL ``loss_fn`` mapping (the section's plain data); raise listing
        all errors."""
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
