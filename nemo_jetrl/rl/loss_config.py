"""Settings of the GRPO loss: `GRPOLossConfig` (NeMo-RL's ``loss_fn`` keys, same defaults; each
key's rule is the typed schema's, `nemo_jetrl.config.nemo_rl_model.LossFn`; `LossConfigError`
lists every problem) and the KL estimator names.

`nemo_jetrl.rl.loss` computes the loss from these settings and re-exports the names here; the
importance-sampling keys of ``loss_fn`` are `nemo_jetrl.rl.correction`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from nemo_jetrl.config.schema import KL_TYPES as KL_TYPES  # re-exported
from nemo_jetrl.rl.correction import (
    CorrectionConfig,
    CorrectionConfigError,
    loss_fn_issues,
    validate_loss_fn_cfg,
)

#: NeMo-RL loss_fn switches this loss does not implement; true/non-zero is an error, not ignored.
_UNSUPPORTED_FLAGS = (
    "disable_ppo_ratio",
    "force_on_policy_ratio",
    "use_cispo",
    "use_kl_in_reward",
)


class LossConfigError(CorrectionConfigError):
    """Invalid ``loss_fn`` settings (loss and IS keys); ``errors`` lists every problem."""

    what = "loss_fn settings"


@dataclass(frozen=True)
class GRPOLossConfig:
    """GRPO loss settings; field names are NeMo-RL's ``loss_fn`` keys (same defaults)."""

    ratio_clip_min: float = 0.2
    """PPO clip: ratios are clipped to [1 - ratio_clip_min, 1 + ratio_clip_max]."""

    ratio_clip_max: float = 0.2
    """Upper PPO clip: ratios above 1 + ratio_clip_max are clipped."""

    ratio_clip_c: float | None = None
    """dual-clip constant c (> 1) bounding the loss of negative-advantage tokens; None: off."""

    reference_policy_kl_penalty: float = 0.01
    """beta of the KL penalty to the reference policy; 0 disables it."""

    reference_policy_kl_type: str = "k3"
    """KL estimator: "k1", "k2" or "k3" (Schulman's estimators)."""

    kl_input_clamp_value: float | None = 20.0
    """clamp of x = ref - curr before the KL estimator; None: no clamp."""

    kl_output_clamp_value: float | None = 10.0
    """clamp of each token's (weighted) KL term; None: no clamp."""

    use_on_policy_kl_approximation: bool = False
    """weight the KL by exp(curr - generation) instead of exp(curr - sg(curr))."""

    token_level_loss: bool = True
    """token mean over the global batch (true) or mean over sequences of token means (false)."""

    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """importance-sampling correction of the rollout/train mismatch."""

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "correction"}
        errs = [str(i) for i in loss_fn_issues(values, path="")]
        if self.correction.token_level_loss != self.token_level_loss:
            errs.append(
                f"token_level_loss={self.token_level_loss} but correction.token_level_loss="
                f"{self.correction.token_level_loss}: they must agree"
            )
        if errs:
            raise LossConfigError(errs)

    @classmethod
    def from_loss_fn_cfg(cls, cfg: Mapping[str, Any], *, path: str = "loss_fn") -> GRPOLossConfig:
        """Build from a NeMo-RL ``loss_fn`` mapping; raise `LossConfigError` with all errors."""
        if not isinstance(cfg, Mapping) and hasattr(cfg, "items"):
            cfg = dict(cfg.items())
        if not isinstance(cfg, Mapping):
            raise LossConfigError([f"{path} must be a mapping, got {type(cfg).__name__}"])
        k = f"{path}." if path else ""
        errs = validate_loss_fn_cfg(cfg, path=path)  # every key's rule, then the IS rules
        for flag in _UNSUPPORTED_FLAGS:
            if cfg.get(flag):
                errs.append(
                    f"{k}{flag}={cfg[flag]!r} is not implemented by nemo_jetrl's GRPO loss "
                    "(local backend): set it to false, or train with the nemo_rl backend"
                )
        nll = cfg.get("positive_example_nll_weight")
        if nll not in (None, 0, 0.0):
            errs.append(
                f"{k}positive_example_nll_weight={nll!r} is not implemented by nemo_jetrl's GRPO "
                "loss (local backend): set it to 0, or train with the nemo_rl backend"
            )
        if errs:
            raise LossConfigError(errs)
        # None means "off" for the optional keys, "use the default" for the others
        optional = ("ratio_clip_c", "kl_input_clamp_value", "kl_output_clamp_value")
        kw: dict[str, Any] = {
            name: cfg[name]
            for name in (
                "ratio_clip_min",
                "ratio_clip_max",
                "reference_policy_kl_penalty",
                "reference_policy_kl_type",
                "use_on_policy_kl_approximation",
                "token_level_loss",
                *optional,
            )
            if name in cfg and (cfg[name] is not None or name in optional)
        }
        return cls(**kw, correction=CorrectionConfig.from_loss_fn_cfg(cfg, path=path))
