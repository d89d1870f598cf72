"""`mismatch_token_sums`: what NeMo-RL's loss wrapper returns per micro-batch (or per packed
sequence). Its sums divided by the usable count are `mismatch_metrics`' token means (float64,
stated bound), sums of any split of a batch add up to the whole batch's, and it reads nothing back
scalar by scalar (a GPU sync each): counted with a dispatch mode, `mismatch_metrics` as the
control that the count sees such reads."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_jetrl.rl.metrics import (
    ADDITIVE_MEANS,
    TOKEN_COUNTS,
    mismatch_metrics,
    mismatch_token_sums,
)

# ops whose result the host must wait for: a scalar read, or a shape that depends on the data
HOST_WAITS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.index.")


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def waits(self) -> int:
        return sum(op.startswith(HOST_WAITS) for op in self.ops)


def batch(seed: int, b: int = 6, t: int = 12, dtype=torch.float32):
    """Random logprobs with the cases the rule must handle: masked positions holding junk, a
    dropped sequence, a NaN, a -inf and a |p - g| beyond LOG_RATIO_LIMIT on valid tokens."""
    gen = torch.Generator().manual_seed(seed)
    g = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    p = g + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3
    tm = (torch.rand(b, t, generator=gen) < 0.8).to(torch.int64)
    tm[0, :3] = 1
    g[0, 0], p[0, 1], p[0, 2] = math.nan, -math.inf, -400.0
    p[1, tm[1] == 0] = math.nan  # junk where the mask is 0
    sm = torch.ones(b)
    sm[-1] = 0
    return g.to(dtype), p.to(dtype), tm, sm


@pytest.mark.parametrize("bounds", [(0.5, 2.0), (0.9, 1.1)])
def test_sums_over_the_usable_count_are_the_token_means(bounds):
    g, p, tm, sm = batch(1)
    sums = mismatch_token_sums(g, p, tm, sm, ratio_bounds=bounds)
    ref = mismatch_metrics(g, p, tm, sm, ratio_bounds=bounds)
    n = sums[TOKEN_COUNTS[0]]
    assert n == ref[TOKEN_COUNTS[0]] > 0
    assert sums[TOKEN_COUNTS[1]] == ref[TOKEN_COUNTS[1]] == 3.0  # the NaN, -inf and -400 tokens
    assert set(sums) == set(ADDITIVE_MEANS + TOKEN_COUNTS)
    for k in ADDITIVE_MEANS:
        assert sums[k] / n == pytest.approx(ref[k], rel=1e-12, abs=1e-14), k
    assert sums["jetrl/mismatch/is_ratio_frac_above"] > 0  # the bounds were exercised
    assert sums["jetrl/mismatch/is_ratio_frac_below"] > 0


def test_sums_of_a_split_batch_add_up_to_the_whole():
    g, p, tm, sm = batch(2)
    whole = mismatch_token_sums(g, p, tm, sm)
    parts = [mismatch_token_sums(g[r], p[r], tm[r], sm[r]) for r in (slice(0, 1), slice(1, 6))]
    for k in ADDITIVE_MEANS + TOKEN_COUNTS:
        assert parts[0][k] + parts[1][k] == pytest.approx(whole[k], rel=1e-12, abs=1e-14), k


def test_no_usable_token_gives_zero_sums_and_the_counts():
    g, p, tm, _ = batch(3, b=2, t=4)
    tm[1] = 1
    out = mismatch_token_sums(g, p, tm, torch.zeros(2))
    assert all(out[k] == 0.0 for k in ADDITIVE_MEANS + TOKEN_COUNTS)
    p = torch.full_like(p, math.nan)
    out = mismatch_token_sums(g, p, tm, None)
    assert out[TOKEN_COUNTS[0]] == 0.0 and out[TOKEN_COUNTS[1]] == float(tm.sum())
    assert all(out[k] == 0.0 for k in ADDITIVE_MEANS)


def test_no_scalar_is_read_back_one_by_one():
    g, p, tm, sm = batch(4)
    with OpLog() as control:
        mismatch_metrics(g, p, tm, sm)
    assert control.waits() > 20  # the counter sees them: ~30 scalars and the boolean selections
    with OpLog() as log:
        mismatch_token_sums(g, p, tm, sm)
    assert log.waits() == 0, [op for op in log.ops if op.startswith(HOST_WAITS)]
    assert log.ops.count("aten.stack.default") == 1  # everything leaves in one tensor


def test_bad_input_names_the_tensor():
    g, p, tm, sm = batch(5)
    with pytest.raises(ValueError, match="token_mask"):
        mismatch_token_sums(g, p, tm[:, :-1], sm)
    with pytest.raises(ValueError, match="ratio_bounds"):
        mismatch_token_sums(g, p, tm, sm, ratio_bounds=(2.0, 1.0))
