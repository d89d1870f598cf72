"""KV duties of our NeMo-RL policy worker against NeMo-RL's real code (imported from the upstream
tree in the NeMo-RL tier): the calibration micro-batches under sequence packing and dynamic
batching with the real ``BatchedDataDict``, and the KV scales every refit ships."""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.backends.nemo_rl.calibration import (
    CalibrationPlanError,
    calibration_micro_batches,
    refit_kv_scales,
)
from nemo_jetrl.kvcache import KVScales

pytestmark = pytest.mark.nemo_rl

LENGTHS = [5, 17, 3, 11, 29, 8, 2, 23, 14, 6]


def _batch():
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    s = max(LENGTHS) + 3
    ids = torch.zeros(len(LENGTHS), s, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = torch.arange(1, n + 1) + 100 * i  # row i is recognisable by its tokens
    return BatchedDataDict(
        {"input_ids": ids, "input_lengths": torch.tensor(LENGTHS, dtype=torch.int32)}
    )


def _packed_shard():
    # What lm_policy.calibrate_qkv_fp8_scales sends one worker (DP=1) with packing on.
    shards, _ = _batch().shard_by_batch_size(
        1,
        batch_size=None,
        sequence_packing_args={
            "algorithm": "modified_first_fit_decreasing",
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "sequence_length_pad_multiple": 1,
            "max_tokens_per_microbatch": 40,
        },
    )
    return shards[0]


def _dynamic_shard():
    shards, _ = _batch().shard_by_batch_size(
        1,
        batch_size=None,
        dynamic_batching_args={
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "sequence_length_round": 4,
            "max_tokens_per_microbatch": 48,
        },
    )
    return shards[0]


def test_plain_slice_drops_the_plan_nemo_rl_asserts_on():
    """The defect: ``slice()`` keeps no micro-batch plan; NeMo-RL's packed iterator asserts."""
    shard = _packed_shard()
    assert len(shard.micro_batch_indices[0]) > 1
    with pytest.raises(AssertionError):
        next(shard.slice(0, 2).make_microbatch_iterator_for_packable_sequences())
    with pytest.raises(AssertionError):
        next(_dynamic_shard().slice(0, 2).make_microbatch_iterator_with_dynamic_shapes())


def _rows(t: torch.Tensor) -> list[int]:
    return [int(r[0]) // 100 for r in t]  # the row id encoded in the first token


@pytest.mark.parametrize("mode", ["packed", "dynamic"])
def test_micro_batches_follow_the_drivers_plan(mode):
    shard = _packed_shard() if mode == "packed" else _dynamic_shard()
    if mode == "packed":
        own = list(shard.make_microbatch_iterator_for_packable_sequences())
    else:
        own = list(shard.make_microbatch_iterator_with_dynamic_shapes())
    parts = list(
        calibration_micro_batches(shard, 4, packed=mode == "packed", dynamic=mode == "dynamic")
    )
    assert len(parts) == len(own) > 1
    seen = []
    plan = shard.micro_batch_lengths[0]
    for (part, size), mb, planned in zip(parts, own, plan, strict=True):
        # NeMo-RL's own iterator over our micro-batch: exactly the micro-batch it planned.
        if mode == "packed":
            got = list(part.make_microbatch_iterator_for_packable_sequences())
            n, longest = part.get_microbatch_iterator_for_packable_sequences_len()
            assert (n, longest) == (1, planned)  # the packed length the driver planned
        else:
            got = list(part.make_microbatch_iterator_with_dynamic_shapes())
            assert part.get_microbatch_iterator_dynamic_shapes_len() == 1
        assert len(got) == 1 and size == mb.size == got[0].size
        for key in ("input_ids", "input_lengths"):
            assert torch.equal(got[0][key], mb[key]), key
        seen += _rows(got[0]["input_ids"])
    assert sorted(seen) == list(range(len(LENGTHS)))  # every sequence once


def test_without_packing_consecutive_slices():
    data = _batch()
    parts = list(calibration_micro_batches(data, 4, packed=False, dynamic=False))
    assert [size for _, size in parts] == [4, 4, 2]
    assert [_rows(p["input_ids"]) for p, _ in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_missing_plan_is_a_clear_error():
    with pytest.raises(CalibrationPlanError, match=r"policy\.sequence_packing\.enabled"):
        list(calibration_micro_batches(_batch(), 4, packed=True, dynamic=False))


def test_refit_ships_our_calibration_under_nemo_rls_names():
    """v0.7.0's colocated refit passes no kv_scales: our last calibration fills in, under the
    names NeMo-RL's refit iterator and vLLM's loader use."""
    from nemo_rl.models.generation.vllm.quantization.fp8_train_utils import (
        get_vllm_qkv_scale_names,
    )

    ours = KVScales({i: {"q": 0.5 + i, "k": 0.25 * (i + 1), "v": 3.0 / (i + 1)} for i in range(3)})
    flat = ours.to_vllm(include_q=True)
    names = {n for i in range(3) for n in get_vllm_qkv_scale_names(i).values()}
    assert set(flat) == names
    assert refit_kv_scales(None, flat) == flat  # colocated v0.7.0: ours, not 1.0
    assert refit_kv_scales(None, None) is None  # before the first calibration: NeMo-RL's 1.0
    assert refit_kv_scales(dict(flat), flat) == flat  # what grpo passes back (from our result)
    bad = dict(flat, **{"model.layers.1.self_attn.k_scale": 1.0})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_scale: refit got 1\.0"):
        refit_kv_scales(bad, flat)
