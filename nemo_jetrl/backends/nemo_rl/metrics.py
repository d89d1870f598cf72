"""Our mismatch metrics inside NeMo-RL's GRPO loop: a loss-function wrapper and a logger proxy.

How NeMo-RL aggregates (both trees, ``nemo_rl/algorithms/grpo.py``): every metric a loss
function returns per micro-batch is *summed* over micro-batches and data-parallel ranks, and its
Megatron worker divides every sum without ``_min``/``_max`` in its name by the step's number of
global batches (``megatron_policy_worker.py``). So a micro-batch returns *sums*: for each
token-mean statistic its sum over the usable tokens, and the usable and non-finite token counts
(`mismatch_token_sums`: one device-to-host copy per call, which matters with sequence packing,
where the loss is called once per packed sequence); the logger proxy divides each sum by the
usable count. The division by the number
of global batches cancels, so the logged value is the token mean over every usable token of the
step, whatever the number of global batches and however many tokens each holds, and NaN when
no token was usable (all sample_mask 0, or every log-ratio non-finite): never a silent 0. A
token whose log-ratio is non-finite or beyond ``LOG_RATIO_LIMIT`` is left out of the means and
counted in ``nonfinite_tokens``. Counts are logged per global batch (the step's totals with one,
NeMo-RL's GRPO default). Only additive statistics can be carried this way; the full set
(per-sequence, min/max, ESS) comes from ``nemo_jetrl.rl.metrics.mismatch_metrics`` when the
logs are analysed offline.

The ratio bounds of ``is_ratio_frac_*`` and ``is_ratio_trunc_mean`` are
``DEFAULT_RATIO_BOUNDS`` here as on the local backend and offline, so a tag means the same in
every run ``jetrl compare`` reads; what the loss's own truncation (``loss_fn``'s TIS keys) did
is NeMo-RL's ``train/is_oob_ratio`` and ``train/sampling_importance_ratio``.

With ``loss_fn.force_on_policy_ratio`` NeMo-RL does not compute the trainer's logprobs before the
update (its ``prev_logprobs`` are zeros) and its loss uses the current ones: so do we.

Names: ``nemo_jetrl.rl.metrics`` tags (``jetrl/mismatch/<name>``). grpo.py logs loss metrics with the
``train/`` prefix; `JetrlLoggerProxy` moves our tags out from under it, so NeMo-RL runs and local
runs write the same tags (``jetrl compare`` reads both).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nemo_jetrl.rl.metrics import (
    ADDITIVE_MEANS,
    DEFAULT_RATIO_BOUNDS,
    TOKEN_COUNTS,
    mismatch_token_sums,
)

PREFIX = "jetrl/"


class MismatchMetricsLoss:
    """Wraps a NeMo-RL loss function (ClippedPGLossFn); adds our additive mismatch metrics.

    The loss value and gradients are the wrapped function's, untouched. Every other attribute
    (``input_type``, ``loss_type``, ...) is the wrapped function's too, so NeMo-RL's dispatch on
    them is unchanged. Picklable (it is shipped to the Megatron workers).
    """

    def __init__(
        self, inner: Any, ratio_bounds: tuple[float, float] = DEFAULT_RATIO_BOUNDS
    ) -> None:
        lo, hi = float(ratio_bounds[0]), float(ratio_bounds[1])
        if not 0.0 <= lo <= hi:  # here on the driver, not in every worker's first loss call
            raise ValueError(f"ratio_bounds must satisfy 0 <= min <= max, got {ratio_bounds}")
        self.inner = inner
        self.ratio_bounds = (lo, hi)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        loss, metrics = self.inner(*args, **kwargs)
        data = kwargs.get("data", args[1] if len(args) > 1 else None)
        if data is None:
            raise TypeError(
                "MismatchMetricsLoss: call with (logprobs, data, global_valid_seqs, "
                "global_valid_toks) as NeMo-RL does"
            )
        if getattr(self.inner, "force_on_policy_ratio", False):  # prev_logprobs are zeros
            curr = kwargs.get("next_token_logprobs", args[0] if args else None)
            if curr is None:
                raise TypeError("MismatchMetricsLoss: next_token_logprobs missing")
            prev = curr.detach()  # the loss's own choice (loss_functions.py, both trees)
        else:
            prev = data["prev_logprobs"][:, 1:]
        extra = mismatch_token_sums(
            data["generation_logprobs"][:, 1:],
            prev,
            data["token_mask"][:, 1:],
            data["sample_mask"],
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
        ours = usable_token_means(ours)
        rest = {k: v for k, v in metrics.items() if k not in ours}
        if rest:
            self.inner.log_metrics(rest, step, prefix, *args, **kwargs)
        if ours:
            self.inner.log_metrics(ours, step, "", *args, **kwargs)


def usable_token_means(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` with each `ADDITIVE_MEANS` sum divided by the usable-token count:
    the step's token means; NaN without a usable token, never a silent 0 (docs/metrics.md)."""
    out = dict(metrics)
    usable = metrics.get(TOKEN_COUNTS[0])
    if usable is None:
        return out
    n = float(usable)
    for k in ADDITIVE_MEANS:
        if k in out:
            out[k] = float(out[k]) / n if n > 0 else float("nan")
    return out
