"""The policy worker's KV duties on NeMo-RL, as plain functions (tested with the real
``BatchedDataDict`` and NeMo-RL's scale names; `worker.py` calls them).

- `calibration_micro_batches`: how the calibration override cuts the worker's data shard into
  micro-batches that NeMo-RL's own ``get_logprobs`` accepts. Under sequence packing or dynamic
  batching the driver (``lm_policy.calibrate_qkv_fp8_scales``) plans the micro-batches with
  ``shard_by_batch_size`` and stores the plan in ``micro_batch_indices`` /
  ``micro_batch_lengths``; NeMo-RL's packed and dynamic iterators assert on it
  (``batched_data_dict.py`` ``make_microbatch_iterator_for_packable_sequences`` /
  ``..._with_dynamic_shapes``) and ``slice()`` drops it. So each planned micro-batch is sliced
  out and carries a one-entry plan of its own (same rows, same padded length), and
  ``get_logprobs`` runs exactly the micro-batch the driver planned.
- `refit_kv_scales`: the KV scales a refit ships. NeMo-RL v0.7.0's colocated refit
  (``grpo.refit_policy_generation``, IPC path) calls ``stream_weights_via_ipc_zmq`` without
  ``kv_scales``, so its iterator appends 1.0 for every scale while the trainer's on-policy KV
  uses the calibrated ones. Our worker overrides the iterator (one home for every refit path in
  both trees: IPC, collective, main's reshard and sparse paths) and fills in its last
  calibration whenever the caller passed none.
- `merge_rank_amax`: the per-rank amax of a calibration merged across ranks (data and pipeline
  parallel) by elementwise max, NaN kept: a NaN on any rank must reach the refusal
  (`kvcache.calibration`), where Python's ``max`` would drop it (``max(5.0, nan)`` is 5.0).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any


class CalibrationPlanError(ValueError):
    """The shard lacks the micro-batch plan NeMo-RL's packed/dynamic iterators need."""


def calibration_micro_batches(
    data: Any, micro_batch_size: int, *, packed: bool, dynamic: bool
) -> Iterator[tuple[Any, int]]:
    """(micro-batch, its sequence count) pairs covering ``data`` (a ``BatchedDataDict``) once.

    Without packing or dynamic batching: consecutive slices of ``micro_batch_size`` rows.
    With either: the driver's plan, one micro-batch per planned entry, each a slice that carries
    ``micro_batch_indices=[[(0, n)]]`` and its planned ``micro_batch_lengths``.
    """
    n = int(data["input_ids"].shape[0])
    if not (packed or dynamic):
        for start in range(0, n, micro_batch_size):
            end = min(start + micro_batch_size, n)
            yield data.slice(start, end), end - start
        return
    indices = getattr(data, "micro_batch_indices", None)
    lengths = getattr(data, "micro_batch_lengths", None)
    mode = "dynamic batching" if dynamic else "sequence packing"
    if not indices or len(indices) != 1 or not lengths or len(lengths[0]) != len(indices[0]):
        raise CalibrationPlanError(
            f"KV calibration with {mode}: the data shard carries no micro-batch plan "
            f"(micro_batch_indices={indices!r}); NeMo-RL's Policy.calibrate_qkv_fp8_scales "
            "makes one with shard_by_batch_size. Call the policy, not the worker, or set "
            "policy.sequence_packing.enabled and policy.dynamic_batching.enabled to false"
        )
    for seqlen, (start, end) in zip(lengths[0], indices[0], strict=True):
        part = data.slice(int(start), int(end))
        part.micro_batch_indices = [[(0, int(end) - int(start))]]
        part.micro_batch_lengths = [[int(seqlen)]]
        yield part, int(end) - int(start)


def refit_kv_scales(
    given: Mapping[str, float] | None, calibrated: Mapping[str, float] | None
) -> dict[str, float] | None:
    """The ``{vLLM scale name: value}`` a refit ships: ``given`` when the caller passed scales
    (they come from our calibration, via grpo's cache), else our last calibration.

    Refuses ``given`` scales that contradict our last calibration for the same name: the
    trainer's on-policy KV runs with ours, so the rollout must get the same numbers.
    """
    if given is None:
        return None if calibrated is None else dict(calibrated)
    if calibrated:
        wrong = [
            f"{k}: refit got {float(v)!r}, the trainer calibrated {float(calibrated[k])!r}"
            for k, v in given.items()
            if k in calibrated and float(v) != float(calibrated[k])
        ]
        if wrong:
            raise ValueError(
                "KV scales passed to the refit differ from the trainer's calibration (the "
                "trainer's on-policy KV uses its own):\n  - " + "\n  - ".join(wrong)
            )
    return dict(given)


def merge_rank_amax(
    parts: Iterable[Mapping[int, Mapping[str, float]] | None],
) -> dict[int, dict[str, float]]:
    """Elementwise max of every rank's ``{layer: {tensor: amax}}`` (layers a rank lacks, as
    under pipeline parallelism, come from the ranks that have them); NaN wins over any number."""
    out: dict[int, dict[str, float]] = {}
    for part in parts:
        for layer, per in (part or {}).items():
            dst = out.setdefault(int(layer), {})
            for t, v in per.items():
                v, old = float(v), dst.get(t)
                if old is None or math.isnan(v) or (not math.isnan(old) and v > old):
                    dst[t] = v
    return out
