"""Our mismatch metrics inside NeMo-RL's GRPO loop: a loss-function wrapper and a logger proxy.

How NeMo-RL aggregates (v0.7.0, ``nemo_rl/algorithms/grpo.py``): every metric a loss function
returns per micro-batch is collected into a list and *summed* over micro-batches and data-parallel
ranks (a few named ones are min/max/mean-reduced). NeMo-RL's own token means survive that because
each micro-batch returns ``sum over its valid tokens / global_valid_toks`` (its ``masked_mean``
with a global normalization factor). We do the same: a micro-batch contributes
``mean_mb(x) * n_mb / global_valid_toks`` for each token-mean statistic, so the logged sum is the
token mean over the whole step. Only additive statistics can be carried that way; the full set
(per-sequence, min/max, ESS) comes from ``nemo_jetrl.rl.metrics.mismatch_metrics`` when the logs are
analysed offline. Counts are summed as they are.

Names: ``nemo_jetrl.rl.metrics`` tags (``jetrl/mismatch/<name>``). grpo.py logs loss metrics with the
``train/`` prefix; `JetrlLoggerProxy` moves our tags out from under it, so NeMo-RL runs and local
runs write the same tags (``jetrl compare`` reads both).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nemo_jetrl.rl.metrics import mismatch_metrics

PREFIX = "jetrl/"
# Token-mean statistics of nemo_jetrl.rl.metrics that are carried as additive contributions.
TOKEN_MEANS = (
    "jetrl/mismatch/k1_kl",
    "jetrl/mismatch/chi2_token",
    "jetrl/mismatch/is_ratio_mean",
    "jetrl/mismatch/is_ratio_frac_above",
    "jetrl/mismatch/is_ratio_frac_below",
    "jetrl/mismatch/is_ratio_trunc_mean",
)
COUNTS = ("jetrl/mismatch/num_valid_tokens", "jetrl/mismatch/nonfinite_tokens")


def additive_mismatch_metrics(
    generation_logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor | None,
    global_valid_toks: float | torch.Tensor,
    *,
    ratio_bounds: tuple[float, float] = (0.0, 2.0),
) -> dict[str, float]:
    """One micro-batch's contributions; summing them over the step gives step-level token means."""
    m = mismatch_metrics(
        generation_logprobs, prev_logprobs, token_mask, sample_mask, ratio_bounds=ratio_bounds
    )
    n = m["jetrl/mismatch/num_valid_tokens"]
    total = float(global_valid_toks)
    out = {k: (m[k] * n / total if n > 0 and total > 0 else 0.0) for k in TOKEN_MEANS}
    out.update({k: m[k] for k in COUNTS})
    return out


class MismatchMetricsLoss:
    """Wraps a NeMo-RL loss function (ClippedPGLossFn); adds our additive mismatch metrics.

    The loss value and gradients are the wrapped function's, untouched. Every other attribute
    (``input_type``, ``loss_type``, ...) is the wrapped function's too, so NeMo-RL's dispatch on
    them is unchanged. Picklable (it is shipped to the Megatron workers).
    """

    def __init__(self, inner: Any, ratio_bounds: tuple[float, float] = (0.0, 2.0)) -> None:
        self.inner = inner
        self.ratio_bounds = (float(ratio_bounds[0]), float(ratio_bounds[1]))

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        loss, metrics = self.inner(*args, **kwargs)
        data = kwargs.get("data", args[1] if len(args) > 1 else None)
        gvt = kwargs.get("global_valid_toks", args[3] if len(args) > 3 else None)
        if data is None or gvt is None:
            raise TypeError(
                "MismatchMetricsLoss: call with (logprobs, data, global_valid_seqs, "
                "global_valid_toks) as NeMo-RL does"
            )
        extra = additive_mismatch_metrics(
            data["generation_logprobs"][:, 1:],
            data["prev_logprobs"][:, 1:],
            data["token_mask"][:, 1:],
            data["sample_mask"],
            gvt,
            ratio_bounds=self.ratio_bounds,
        )
        clash = set(extra) & set(metrics)
        if clash:
            raise RuntimeError(f"loss metrics already contain {sorted(clash)}")
        return loss, {**metrics, **extra}


class JetrlLoggerProxy:
    """A NeMo-RL Logger whose ``log_metrics`` writes ``jetrl/...`` tags without any prefix."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def log_metrics(
        self,
        metrics: Mapping[str, Any],
        step: int,
        prefix: str | None = "",
        *args: Any,
        **kwargs: Any,
    ) -> None:
        ours = {k: v for k, v in metrics.items() if isinstance(k, str) and k.startswith(PREFIX)}
        rest = {k: v for k, v in metrics.items() if k not in ours}
        if rest:
            self.inner.log_metrics(rest, step, prefix, *args, **kwargs)
        if ours:
            self.inner.log_metrics(ours, step, "", *args, **kwargs)
