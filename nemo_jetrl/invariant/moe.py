"""Batch-invariant mixture-of-experts routing and combine: the MoE sibling of the dense ops.

A token's path through an MoE block is: router logits (a narrow GEMM ``[H] x [E, H]``),
softmax, top-k experts, optional renormalisation of the top-k weights, the experts' outputs,
and their weighted sum. Each step here gives a token the same bits whatever batch, sequence
length or padding it is computed with, using `ops` only:

- logits: `ops.linear` (fp32 products, `ops.tree_sum`) when ``invariant``;
- softmax: `ops.softmax` (elementwise exp, fixed-tree sum);
- top-k: a stable descending sort per row, so equal probabilities go to the lower expert index
  (``torch.topk`` leaves ties unspecified);
- renormalisation and combine: `ops.tree_sum` over the k slots, in slot order (highest
  probability first), never in the order experts happen to be visited.

``invariant=False`` keeps the same rules with torch's own GEMM/softmax/sum (the BF16 path's
speed, not its bits). Depends on torch and `ops` alone.
"""

from __future__ import annotations

import torch

from nemo_jetrl.invariant import ops


def router_logits(x: torch.Tensor, weight: torch.Tensor, *, invariant: bool) -> torch.Tensor:
    """``x @ weight.T`` in ``x.dtype`` (the router is never FP8)."""
    if invariant:
        return ops.linear(x, weight)
    return torch.nn.functional.linear(x, weight.to(x.dtype))


def router_probs(logits: torch.Tensor, *, invariant: bool) -> torch.Tensor:
    """fp32 softmax over experts."""
    return ops.softmax(logits.float()) if invariant else torch.softmax(logits.float(), dim=-1)


def top_k(probs: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, k]`` int64 expert indices, highest probability first; ties: lower index first."""
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
    return order[..., :k]


def slot_weights(
    probs: torch.Tensor, idx: torch.Tensor, *, normalize: bool, invariant: bool
) -> torch.Tensor:
    """fp32 ``[T, k]`` weights of the chosen experts (renormalised to sum 1 when asked).
    Differentiable in ``probs``: with replayed ``idx`` the router still gets its gradient."""
    w = probs.gather(-1, idx)
    if normalize:
        total = ops.tree_sum(w, dim=-1, keepdim=True) if invariant else w.sum(-1, keepdim=True)
        w = w / total
    return w


def group_by_expert(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the flattened ``[T*k]`` slots sorted by expert (stable: token order within an
    expert) and ``offsets [E+1]`` int64: expert ``e`` owns sorted rows ``offsets[e]:offsets[e+1]``."""
    flat = idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    # scatter-add, not bincount: bincount sizes its output by the largest id, a read of the
    # device's data on the host at every MoE layer of every decode step
    counts = torch.zeros(num_experts, dtype=torch.int64, device=idx.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=idx.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return order, offsets


def combine(y: torch.Tensor, w: torch.Tensor, *, invariant: bool) -> torch.Tensor:
    """fp32 ``sum_k w[t, k] * y[t, k, :]`` for ``y [T, k, H]``, in slot order."""
    prod = y.float() * w.float().unsqueeze(-1)
    return ops.tree_sum(prod, dim=1) if invariant else prod.sum(1)
