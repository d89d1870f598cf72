"""Edges of the deferred non-finite flags (fp8/finite_flags.py; the per-expert flags of
fp8/experts.py).

The CUDA behaviour (no host read; flags read once by `check_non_finite`) runs here on CPU
tensors with `finite_flags.sync_free` patched to True (a STAND-IN for "this tensor is on a
GPU", as test_fp8_experts.py's deferred test does); the quantizers are the real torch ones."""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.fp8 import finite_flags
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.experts import grouped_fp8_linear

NAN = float("nan")


@pytest.fixture(autouse=True)
def _fresh_flags(monkeypatch):
    monkeypatch.setattr(finite_flags, "_FLAGS", {})
    monkeypatch.setattr(finite_flags, "_SPARE", {})
    monkeypatch.setattr(finite_flags, "_TEMPLATES", set())


def _raises(names: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        finite_flags.check_non_finite()
    assert str(err.value).startswith(f"non-finite values in FP8 operand(s) {names} ")
    assert finite_flags.pending() == 0


def test_a_later_finite_record_under_the_same_name_keeps_the_flag():
    """Five quantizations of one tensor name per step (micro-batches): a NaN in the first is
    still reported after four finite ones, whether the kernel set the flag or `record` did."""
    good, bad = torch.ones(2, 3), torch.tensor([[1.0, NAN, 1.0], [1.0, 1.0, 1.0]])
    finite_flags.record("l0.x", bad)
    for _ in range(4):
        finite_flags.record("l0.x", good)
    finite_flags.flag("l1.dy", "cpu").fill_(1)  # as a quantizer kernel writes it
    finite_flags.record("l1.dy", good)
    finite_flags.record("l2.x", good)
    _raises(["l0.x", "l1.dy"])


def test_flags_are_cleared_by_the_read_and_reused():
    """After a step that raised, the next step's finite records pass, on the same buffers."""
    f = finite_flags.flag("l0.x", "cpu")
    finite_flags.record("l0.x", torch.tensor([NAN]))
    finite_flags.record("l1.x", torch.ones(2))
    _raises(["l0.x"])
    assert finite_flags.flag("l0.x", "cpu") is f and int(f) == 0
    finite_flags.record("l0.x", torch.ones(2))
    finite_flags.record("l1.x", torch.ones(2))
    finite_flags.check_non_finite()  # nothing pending is bad: no error
    finite_flags.record("l1.x", torch.tensor([1.0, NAN]))
    _raises(["l1.x"])


def test_names_are_matched_to_their_own_flags_in_one_read():
    """Plain flags and per-group flags of several widths in one read: each name gets its own
    values (the read concatenates them all)."""
    finite_flags.record_each("a.expert{}.input", torch.tensor([False, False, True]))
    finite_flags.record("b.x", torch.ones(1))
    finite_flags.record_each("c.expert{}.weight", torch.tensor([True, False, False, False, True]))
    finite_flags.record("d.x", torch.tensor([NAN]))
    finite_flags.record_each("e.expert{}.input", torch.tensor([False, False]))
    _raises(["a.expert2.input", "c.expert0.weight", "c.expert4.weight", "d.x"])


def test_group_flags_recorded_twice_accumulate():
    finite_flags.record_each("m.expert{}.input", torch.tensor([False, True, False, False]))
    finite_flags.record_each("m.expert{}.input", torch.tensor([False, False, False, True]))
    finite_flags.record_each("m.expert{}.input", torch.tensor([False, False, False, False]))
    _raises(["m.expert1.input", "m.expert3.input"])


COUNTS = [129, 0, 1, 127, 128]  # offsets 0, 129, 129, 130, 257, 385


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m = sum(COUNTS)
    x = torch.randn(m, 128, generator=g).to(torch.bfloat16)
    w = (torch.randn(len(COUNTS), 256, 128, generator=g) * 0.05).to(torch.bfloat16)
    offsets = torch.tensor([0, *torch.tensor(COUNTS).cumsum(0).tolist()])
    return x, w, offsets


@pytest.mark.parametrize(
    ("row", "expert"),
    [(0, 0), (127, 0), (128, 0), (129, 2), (130, 3), (256, 3), (257, 4), (384, 4)],
)
def test_deferred_input_flag_blames_the_expert_owning_the_row(monkeypatch, row, expert):
    """First and last row of each expert's part, across its 128-token blocks, around an empty
    expert (1): the flag names the expert whose rows hold the NaN, and only it."""
    monkeypatch.setattr(finite_flags, "sync_free", lambda t: True)  # STAND-IN: "on a GPU"
    x, w, offsets = _data(row)
    x[row, 5] = NAN
    grouped_fp8_linear(x, w, offsets, Fp8LinearConfig.te_blockwise(), "moe")
    _raises([f"moe.expert{expert}.input"])


@pytest.mark.parametrize(("row", "expert"), [(128, 0), (129, 2), (257, 4), (384, 4)])
def test_deferred_grad_flag_blames_the_expert_owning_the_token_block(monkeypatch, row, expert):
    """The backward quantizes dy per row (DGrad) and per 128-token block of each expert (WGrad,
    blocks restart at each expert): a NaN in a block's edge row names that expert alone."""
    monkeypatch.setattr(finite_flags, "sync_free", lambda t: True)  # STAND-IN: "on a GPU"
    x, w, offsets = _data(100 + row)
    x.requires_grad_(True)
    w.requires_grad_(True)  # WGrad too: dy quantized per 128-token block of each expert
    y = grouped_fp8_linear(x, w, offsets, Fp8LinearConfig.te_blockwise(), "moe")
    finite_flags.check_non_finite()  # the forward's inputs are finite
    dy = torch.ones_like(y)
    dy[row, 3] = NAN
    y.backward(dy)
    _raises([f"moe.expert{expert}.grad_output"])
