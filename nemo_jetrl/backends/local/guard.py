"""The update guard: an optimizer step that leaves a master or compute weight non-finite, or
the policy's forward non-finite, is refused and undone, like a refused refit.

`Trainer.update` already skips a step whose gradient is not finite; a finite gradient can still
poison the weights (a learning rate that overflows, Adam's state blowing up, a compute weight
that rounds to BF16 infinity) or make torch's Adam raise (a step size beyond float range). `guarded_update` keeps a copy of the fp32 masters and of the
optimizer state, runs the update, and when any weight is not finite afterwards, the step
overflowed, or the updated policy's forward on the step's first sequence is not finite (finite
but huge weights, e.g. from lr 1e10, overflow the activations) puts both back
(and the compute weights from them), so the run continues on the last good weights and a
checkpoint never holds a non-finite tensor or weights whose forward is not finite. Cost: one
copy of the masters and of the Adam state, and one no-grad forward of one sequence, per step
(the local backend's models are small).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from nemo_jetrl.backends.local.trainer import Trainer
from nemo_jetrl.fp8 import check_non_finite


def _nonfinite_weights(trainer: Trainer) -> list[str]:
    bad = []
    for name, m, p in zip(trainer.names, trainer.master, trainer.params, strict=True):
        if not (bool(torch.isfinite(m).all()) and bool(torch.isfinite(p).all())):
            bad.append(name)
    return bad


def _probe_problem(trainer: Trainer, input_ids: torch.Tensor, prompt_len: int) -> str:
    """Why the updated policy's forward on one training sequence is unusable ("" if it is not):
    finite weights can still be huge enough (lr 1e10) that activations overflow."""
    try:
        lp = trainer.score(input_ids[:1], prompt_len)
        # On CUDA the quantizers flag non-finite operands instead of raising: read (and clear)
        # the flags here, or the next step's update would raise on good weights.
        check_non_finite()
    except ValueError as exc:  # our quantizer refuses non-finite activations by name
        return str(exc).splitlines()[0]
    return "" if bool(torch.isfinite(lp).all()) else "its token logprobs are non-finite"


def guarded_update(
    trainer: Trainer, input_ids: torch.Tensor, prompt_len: int, **kwargs: Any
) -> tuple[dict[str, float], str]:
    """`Trainer.update`, undone when it leaves a weight non-finite or the policy's forward on
    the step's first sequence non-finite.

    Returns (the update's metrics plus ``jetrl/local/update_refused``, the refusal message or
    "" when the update was kept)."""
    masters = [m.detach().clone() for m in trainer.master]
    opt_state = copy.deepcopy(trainer.optimizer.state_dict())
    lr = float(trainer.optimizer.param_groups[0]["lr"])
    try:
        metrics = trainer.update(input_ids, prompt_len, **kwargs)
    except RuntimeError as exc:  # torch's Adam: a step size beyond float range
        if "overflow" not in str(exc):
            raise
        metrics = {"train/lr": lr}
        why = f"the optimizer step overflowed ({exc}; lr {lr})"
    else:
        bad = _nonfinite_weights(trainer)
        shown = ", ".join(bad[:3]) + (" ..." if len(bad) > 3 else "")
        grad = metrics.get("train/grad_norm")
        why = (
            f"the optimizer step made {len(bad)} of {len(trainer.names)} weight(s) non-finite "
            f"({shown}; lr {lr}, grad norm {grad})"
            if bad
            else ""
        )
        if not why and (probe := _probe_problem(trainer, input_ids, prompt_len)):
            why = f"the updated policy's forward is not finite ({probe}; lr {lr}, grad norm {grad})"
    metrics["jetrl/local/update_refused"] = float(bool(why))
    if not why:
        return metrics, ""
    trainer.load_master(dict(zip(trainer.names, masters, strict=True)))
    trainer.optimizer.load_state_dict(opt_state)
    for m in trainer.master:
        m.grad = None
    trainer.model.eval()
    return metrics, f"update refused: {why}; kept the last good weights and optimizer state"
