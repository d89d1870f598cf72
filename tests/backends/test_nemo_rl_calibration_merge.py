"""The KV calibration's merge across ranks (`backends/nemo_rl/calibration.merge_rank_amax`, what our
NeMo-RL policy worker applies to the ``all_gather_object`` of every rank's amax).

Elementwise max, layers a rank lacks (pipeline parallel) taken from the ranks that have them, and
a NaN on any rank kept, so the layer is refused with its previous scales kept
(`kvcache.calibration.scales_from_amax`) as it is on one rank. Python's own ``max`` drops a NaN
in either order (``max(-inf, nan)`` is -inf, ``max(5.0, nan)`` is 5.0): with it a rank's NaN
became the other ranks' scale (found by reading, 2026-12-01; one rank, what the tests and the
rehearsal run, refused it all along).
"""

from __future__ import annotations

import math

import pytest

from nemo_jetrl.backends.nemo_rl.calibration import merge_rank_amax
from nemo_jetrl.kvcache import CalibrationSettings, KVScales
from nemo_jetrl.kvcache.calibration import scales_from_amax


def test_ranks_merge_by_elementwise_max_over_the_union_of_layers():
    ranks = [
        {0: {"k": 2.0, "v": 7.0}, 1: {"k": 1.0, "v": 1.0}},
        {0: {"k": 3.0, "v": 5.0}},  # a pipeline stage without layer 1
        None,  # a rank that observed nothing
        {"2": {"k": 4.0, "v": 4.0}},  # keys may arrive as strings after a gather
    ]
    assert merge_rank_amax(ranks) == {
        0: {"k": 3.0, "v": 7.0},
        1: {"k": 1.0, "v": 1.0},
        2: {"k": 4.0, "v": 4.0},
    }


@pytest.mark.parametrize("nan_rank", [0, 1, 2])
def test_a_nan_on_any_rank_survives_the_merge_and_the_layer_is_refused(nan_rank):
    ranks = [{0: {"k": 2.0, "v": 2.0}, 1: {"k": 3.0, "v": 3.0}} for _ in range(3)]
    ranks[nan_rank][1]["v"] = math.nan
    merged = merge_rank_amax(ranks)
    assert merged[0] == {"k": 2.0, "v": 2.0} and merged[1]["k"] == 3.0
    assert math.isnan(merged[1]["v"])
    previous = KVScales(layers={0: {"k": 0.5, "v": 0.5}, 1: {"k": 0.25, "v": 0.25}})
    with pytest.warns(UserWarning, match="layer 1: refused"):
        scales, refused = scales_from_amax(merged, CalibrationSettings(), previous)
    assert set(refused) == {1}
    assert scales.layers[1] == {"k": 0.25, "v": 0.25}  # the previous scales, not a rank's
    assert scales.layers[0] != previous.layers[0]  # layer 0 calibrated from the merge
