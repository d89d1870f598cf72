"""ICE-POP and seq-mask-tis keep a ratio that equals either bound, drop one a single ulp outside.

NeMo-RL's rule is ``min <= ratio <= max`` at both ends. The ratio here is exactly 1.0
(prev == gen), so each bound can sit exactly on it or one float64 ulp beside it.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_jetrl.rl.correction import CorrectionConfig
from nemo_jetrl.rl.weights import importance_weights

ONE_UP = math.nextafter(1.0, 2.0)
ONE_DOWN = math.nextafter(1.0, 0.0)
IS_OOB = "train/is_oob_ratio"


def _weights(mode: str, lo: float, hi: float):
    gen = torch.zeros(2, 3, dtype=torch.float64)
    prev = gen.clone()  # every ratio is exp(0) = 1.0 exactly
    mask = torch.ones(2, 3, dtype=torch.long)
    cfg = CorrectionConfig.for_mode(mode, ratio_max=hi, ratio_min=lo)
    return importance_weights(gen, prev, mask, config=cfg)


@pytest.mark.parametrize("mode", ["icepop", "seq-mask-tis"])
@pytest.mark.parametrize(
    "lo, hi, kept",
    [
        (1.0, 4.0, True),  # ratio on the lower bound: kept
        (ONE_UP, 4.0, False),  # one ulp below it: dropped
        (0.25, 1.0, True),  # ratio on the upper bound: kept
        (0.25, ONE_DOWN, False),  # one ulp above it: dropped
        (1.0, 1.0, True),  # both bounds on it
    ],
)
def test_a_ratio_on_either_bound_is_kept(mode: str, lo: float, hi: float, kept: bool) -> None:
    r = _weights(mode, lo, hi)
    want = torch.full((2, 3), 1.0 if kept else 0.0, dtype=r.weights.dtype)
    assert torch.equal(r.weights, want), (mode, lo, hi, r.weights)
    assert r.stats[IS_OOB] == (0.0 if kept else 1.0)
