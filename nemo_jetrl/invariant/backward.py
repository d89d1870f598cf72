"""Backward passes of the linears whose forward this package (or the local backend) computes.

They are not part of the on-policy promise, which is about forwards (a token's probability in the
rollout and in the trainer), so they use torch's float32 GEMMs. Kept out of `ops`, whose public
functions are the batch-invariant ops (`benchmarks/gpu/bench_local_grpo.py` times each of them as
the invariant ops' share of a step).
"""

from __future__ import annotations

from typing import Any

import torch


def linear_grads(
    ctx: Any, g: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The backward of a linear whose ``ctx`` saved ``(x, weight)`` and ``has_bias``: float32
    GEMMs of the gradient and operands, each gradient rounded once to its tensor's dtype, only
    those ``ctx.needs_input_grad`` asks for. Not part of the on-policy promise (forwards only)."""
    x, weight = ctx.saved_tensors
    g2 = g.reshape(-1, g.shape[-1]).float()
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    dx = (g2 @ weight.float()).to(x.dtype).reshape(x.shape) if need_x else None
    dw = (g2.t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype) if need_w else None
    db = g2.sum(0).to(weight.dtype) if ctx.has_bias and need_b else None
    return dx, dw, db
