"""Edges of NeMo-RL's truncated-IS rules as `rl.correction` checks a ``loss_fn`` mapping: which
types need ``truncated_importance_sampling_ratio_min`` (the masking ones: icepop, seq-mask-tis)
and that a lower bound equal to the upper one is a valid (if narrow) window."""

from __future__ import annotations

import pytest

from nemo_jetrl.rl.correction import TIS_TYPES, validate_loss_fn_cfg

MIN_KEY = "loss_fn.truncated_importance_sampling_ratio_min"


def _cfg(tis_type: str, ratio: float = 2.0, ratio_min: float | None = None) -> dict:
    return {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": tis_type,
        "truncated_importance_sampling_ratio": ratio,
        "truncated_importance_sampling_ratio_min": ratio_min,
    }


@pytest.mark.parametrize("tis_type", TIS_TYPES)
def test_masking_types_need_a_lower_bound_and_plain_tis_does_not(tis_type):
    errs = validate_loss_fn_cfg(_cfg(tis_type))
    if tis_type == "tis":
        assert errs == []
    else:
        assert errs == [
            f"{MIN_KEY} must be set when loss_fn.truncated_importance_sampling_type is "
            f"{tis_type!r} (it drops tokens/sequences whose weight is outside [min, max]): set "
            "a lower bound, e.g. 0.5"
        ]
    assert validate_loss_fn_cfg(_cfg(tis_type, ratio_min=0.5)) == []


@pytest.mark.parametrize("tis_type", TIS_TYPES)
def test_a_lower_bound_equal_to_the_ratio_is_valid_and_one_above_is_not(tis_type):
    assert validate_loss_fn_cfg(_cfg(tis_type, ratio=1.5, ratio_min=1.5)) == []
    (err,) = validate_loss_fn_cfg(_cfg(tis_type, ratio=1.5, ratio_min=1.75))
    assert err == f"{MIN_KEY} (1.75) must be <= loss_fn.truncated_importance_sampling_ratio (1.5)"
