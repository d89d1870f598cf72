"""Calibration pieces that need torch only: reductions, masks, layouts, scales."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_jetrl.kvcache import (
    AmaxObserver,
    CalibrationSettings,
    masked_amax,
    reduce_samples,
    scale_from_amax,
    select_sequences,
    token_mask,
)


def test_percentile_is_nearest_rank_half_even() -> None:
    vals = [float(v) for v in range(1, 1001)]
    assert reduce_samples(vals, "percentile", 99.9) == 999.0  # index round(998.001) = 998
    assert reduce_samples([4.0, 1.0, 3.0, 2.0], "percentile", 50) == 3.0  # round(1.5) = 2
    assert reduce_samples([1.0, 2.0, 3.0], "percentile", 99.9) == 3.0  # few samples: the max
    assert reduce_samples([5.0, 1.0], "max") == 5.0
    assert math.isnan(reduce_samples([1.0, float("nan")], "max"))
    with pytest.raises(ValueError):
        reduce_samples([], "max")


def test_token_masks() -> None:
    am = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    rm = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])  # response mask may cover padding
    assert token_mask(am, rm, "none") is None
    assert torch.equal(token_mask(am, rm, "prompt_and_response"), am.bool())
    assert torch.equal(
        token_mask(am, rm, "response"), torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]]).bool()
    )
    with pytest.raises(ValueError, match="response_mask"):
        token_mask(am, None, "response")


@pytest.mark.parametrize("layout", ["bhtd", "bthd", "sbhd"])
def test_masked_amax_layouts_and_nan_padding(layout: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 4, generator=g)  # b h t d
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]).bool()
    x[0, :, 3] = float("nan")  # padding may hold anything
    x[1, 1, 4, 2] = 1e6
    want = max(float(x[0, :, :2].abs().max()), float(x[1, :, :4].abs().max()))
    arranged = {"bhtd": x, "bthd": x.permute(0, 2, 1, 3), "sbhd": x.permute(2, 0, 1, 3)}[layout]
    assert float(masked_amax(arranged, mask, layout)) == want
    obs = AmaxObserver(include_q=False)
    obs.set_mask(mask)
    obs.observe(0, None, arranged, arranged, layout=layout)
    obs.set_mask(None)
    obs.observe(0, None, arranged.nan_to_num(nan=0.0), arranged.nan_to_num(nan=0.0), layout=layout)
    assert obs.samples() == {0: {"k": [want, 1e6], "v": [want, 1e6]}}
    assert obs.amax("max") == {0: {"k": 1e6, "v": 1e6}}


def test_observer_refuses_mismatched_mask() -> None:
    obs = AmaxObserver()
    obs.set_mask(torch.ones(2, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="layer 3"):
        obs.observe(3, torch.zeros(2, 4, 1, 8), torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8))


def test_select_sequences_is_even_and_deterministic() -> None:
    assert select_sequences(8, 1.0).tolist() == list(range(8))
    assert select_sequences(8, 0.5).tolist() == [0, 2, 4, 6]
    assert select_sequences(10, 0.25).tolist() == [0, 3, 6]
    assert select_sequences(3, 0.01).tolist() == [0]


def test_scale_from_amax_is_one_fp32_rounding() -> None:
    s = scale_from_amax(3.7, 1.05)
    assert s == float(torch.tensor(3.7 * 1.05 / 448.0, dtype=torch.float64).float())
    assert scale_from_amax(0.0, 1.05) == 0.0
    assert scale_from_amax(1e-45, 1.0) == 0.0  # underflows fp32: will be refused
    assert math.isinf(scale_from_amax(math.inf, 1.0))


def test_settings_problems_name_every_key() -> None:
    s = CalibrationSettings()
    assert s.problems() == []
    with pytest.raises(ValueError, match="micro_batch_size"):
        CalibrationSettings(micro_batch_size=0)
