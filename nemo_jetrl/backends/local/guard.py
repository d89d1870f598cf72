"""The update guard: an optimizer step that leaves a master or compute weight non-finite is
refused and undone, like a refused refit.

`Trainer.update` already skips a step whose gradient is not finite; a finite gradient can still
poison the weights (a learning rate that overflows, Adam's state blowing up, a compute weight
that rounds to BF16 infinity) or make torch's Adam raise (a step size beyond float range). `guarded_update` keeps a copy of the fp32 masters and of the
optimizer state, runs the update, and when any weight is not finite afterwards (or the step
overflowed) puts both back
(and the compute weights from them), so the run continues on the last good weights and a
checkpoint never holds a non-finite tensor. Cost: one copy of the masters and of the Adam
state per step (the local backend's models are small).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from nemo_jetrl.backends.local.trainer import Trainer


def _nonfinite_weights(trainer: Trainer) -> list[str]:
    bad = []
    for name, m, p in zip(trainer.names, trainer.master, trainer.params, strict=True):
        if not (bool(torch.isfinite(m).all()) and bool(torch.isfinite(p).all())):
            bad.append(name)
    return bad


def guarded_update(trainer: Trainer, *args: Any, **kwargs: Any) -> tuple[dict[str, float], str]:
    """`Trainer.update`, undone when it leaves a weight non-finite.

    Returns (the update's metrics plus ``jetrl/local/update_refused``, the refusal message or
    "" when the update was kept)."""
    masters = [m.detach().clone() for m in trainer.master]
    opt_state = copy.deepcopy(trainer.optimizer.state_dict())
    lr = float(trainer.optimizer.param_groups[0]["lr"])
    try:
        metrics = trainer.update(*args, **kwargs)
    except RuntimeError as exc:  # torch's Adam: a step size beyond float range
        if "overflow" not in str(exc):
            raise
        metrics = {"train/lr": lr}
        why = f"the optimizer step overflowed ({exc}; lr {lr})"
    else:
        bad = _nonfinite_weights(trainer)
        shown = ", ".join(bad[:3]) + (" ..." if len(bad) > 3 else "")
        why = (
            f"the optimizer step made {len(bad)} of {len(trainer.names)} weight(s) non-finite "
            f"({shown}; lr {lr}, grad norm {metrics.get('train/grad_norm')})"
            if bad
            else ""
        )
    metrics["jetrl/local/update_refused"] = float(bool(why))
    if not why:
        return metrics, ""
    trainer.load_master(dict(zip(trainer.names, masters, strict=True)))
    trainer.optimizer.load_state_dict(opt_state)
    for m in trainer.master:
        m.grad = None
    trainer.model.eval()
    return metrics, f"update refused: {why}; kept the last good weights and optimizer state"
