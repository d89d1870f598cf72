"""`sync_check.no_host_reads`: every host read it promises to catch raises, sync-free ops do not."""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.fp8.sync_check import HostReadError, no_host_reads

X = torch.arange(12, dtype=torch.float32).reshape(4, 3) - 5
MASK = X > 0
REPEATS = torch.tensor([1, 2, 0, 1])

HOST_READS = {
    "item": lambda: X[0, 0].item(),
    "tolist": lambda: X.tolist(),
    "numpy": lambda: X.numpy(),
    "cpu": lambda: X.cpu(),
    "to_cpu_str": lambda: X.to("cpu"),
    "to_cpu_kw": lambda: X.to(device="cpu:0"),
    "bool": lambda: bool(X[0, 0] > 0),
    "int": lambda: int(X[0, 0]),
    "float": lambda: float(X[0, 0]),
    "index": lambda: [0, 1, 2][X[0, 0].long().abs() % 3],
    "if_tensor": lambda: 1 if X.sum() > 0 else 0,
    "mask_getitem": lambda: X[MASK],
    "mask_getitem_tuple": lambda: X[MASK[:, 0], 1:],
    "mask_setitem": lambda: X.clone().__setitem__(MASK, 0.0),
    "uint8_mask": lambda: X[MASK.to(torch.uint8).bool()],
    "index_put_mask": lambda: X.clone().index_put_((MASK,), torch.tensor(1.0)),
    "nonzero": lambda: MASK.nonzero(),
    "where_one_arg": lambda: torch.where(MASK),
    "argwhere": lambda: torch.argwhere(MASK),
    "masked_select": lambda: X.masked_select(MASK),
    "unique": lambda: torch.unique(X),
    "unique_dim": lambda: torch.unique(X, dim=0),
    "unique_consecutive": lambda: torch.unique_consecutive(X),
    "repeat_interleave_tensor": lambda: X.repeat_interleave(REPEATS, dim=0),
    "repeat_interleave_repeats_only": lambda: torch.repeat_interleave(REPEATS),
    "bincount": lambda: torch.bincount(REPEATS),
    "equal": lambda: torch.equal(X, X),
    "allclose": lambda: torch.allclose(X, X),
}

SYNC_FREE = {
    "arith": lambda: (X * 2 + 1).sum(0),
    "where_three_args": lambda: torch.where(MASK, X, 0.0),
    "masked_fill": lambda: X.masked_fill(MASK, 0.0),
    "int_index_tensor": lambda: X[torch.tensor([0, 2])],
    "repeat_interleave_int": lambda: X.repeat_interleave(2, dim=0),
    "repeat_interleave_sized": lambda: X.repeat_interleave(REPEATS, dim=0, output_size=4),
    "to_dtype": lambda: X.to(torch.bfloat16),
    "to_same_device": lambda: X.to(X.device) + 0,
    "slices_and_views": lambda: X[1:, :2].t().contiguous().view(-1),
    "isfinite_all": lambda: torch.isfinite(X).all(),
}


@pytest.mark.parametrize("name", sorted(HOST_READS))
def test_host_reads_are_caught(name):
    with pytest.raises(HostReadError, match="host"), no_host_reads():
        HOST_READS[name]()


@pytest.mark.parametrize("name", sorted(SYNC_FREE))
def test_sync_free_ops_pass(name):
    with no_host_reads() as mode:
        SYNC_FREE[name]()
    assert mode.ops_seen > 0


def test_modes_are_removed_on_exit_even_after_an_error():
    with pytest.raises(HostReadError), no_host_reads():
        X.tolist()
    assert X.tolist()[0][0] == -5.0  # no mode left behind
    assert bool(MASK.any())
