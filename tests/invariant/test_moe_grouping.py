"""`invariant.moe.group_by_expert` sorts a MoE layer's slots by expert without a host read:
``torch.bincount`` sized its output by the largest expert id, read from the device at every MoE
layer of every decode step (decode-loop review, session 38). Same offsets as a count in
Python."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_jetrl.invariant.moe import group_by_expert


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_offsets_and_order_match_a_count_in_python_with_no_bincount():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 6, (13, 2), generator=g)
    # ids 0..5 of 8 experts: experts 6 and 7 are never chosen (empty groups)
    with _Ops() as ops:
        order, offsets = group_by_expert(idx, 8)
    flat = idx.reshape(-1).tolist()
    want = [0]
    for e in range(8):
        want.append(want[-1] + flat.count(e))
    assert offsets.tolist() == want and offsets.dtype == torch.int64
    assert [flat[i] for i in order.tolist()] == sorted(flat)  # grouped by expert
    assert not any(n.startswith(("bincount", "_local_scalar_dense", "item")) for n in ops.names)
