"""What the invariant-kernel test modules share: bit views and the batch-invariance check.

A kernel is batch-invariant when a row's output bits do not depend on which other rows are in
the batch or where the row sits: `batch_variance` runs ``fn`` on the first ``m`` rows for each
``m`` and on the rows reversed, and names every case whose rows differ from the full batch's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

BATCH_SIZES = (1, 3, 8, 17)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The integer view of ``t`` on the CPU (so -0.0 != +0.0 and NaN == NaN of the same bits)."""
    t = t.detach().cpu().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def batch_variance(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, sizes: Sequence[int] = BATCH_SIZES
) -> list[str]:
    """Cases where ``fn``'s rows (dim 0) differ from ``fn(x)``'s: ``m=K`` (the first K rows
    alone) and ``reversed`` (every row at another position). Empty: batch-invariant here."""
    full = fn(x)
    bad = [f"m={m}" for m in sizes if m < x.shape[0] and not same_bits(fn(x[:m]), full[:m])]
    flip = torch.arange(x.shape[0] - 1, -1, -1, device=x.device)
    if not same_bits(fn(x[flip]), full[flip]):
        bad.append("reversed")
    return bad
