"""Every rank of one vLLM engine agrees on a refit's outcome before any of them keeps it.

At vLLM ``tensor_parallel_size`` > 1 each rank's worker runs the refit on its own shards: NeMo-RL
calls the transport on every worker, and each one loads, checks parity on its part and, on a
failure, rolls its own shards back. Alone, that leaves an engine whose rank 0 holds the new
weights and whose rank 1 holds the old ones: a half-refit engine that a caught error would
roll out with. So after its own outcome is known each rank shares it over the engine's
tensor-parallel CPU group (one gloo all-reduce of ``tp`` integers, no GPU work) and every rank
then rolls back if any failed: all-or-nothing for the engine, not per rank.

Every rank reaches the vote, whatever happened to it (the hook catches its errors first), so
the collective cannot be left waiting by a rank that raised.
"""

from __future__ import annotations

from typing import Any

import torch

LOADED, RETURNED_FALSE, RAISED = 0, 1, 2
"""A rank's outcome: kept the refit; the transport returned False (NeMo-RL caught its error);
our hook or the transport raised (refusal, parity failure)."""


def outcome(ok: bool) -> int:
    """A transport's outcome from what it returned (it did not raise)."""
    return LOADED if ok else RETURNED_FALSE


def tensor_parallel_size(worker: Any) -> int:
    """The engine's vLLM ``tensor_parallel_size`` as the worker's config has it."""
    return int(getattr(worker.vllm_config.parallel_config, "tensor_parallel_size", 1))


def engine_outcomes(worker: Any, outcome: int) -> list[int]:
    """Every tensor-parallel rank's outcome by rank (this rank's ``outcome`` included); a
    single-rank engine's is ``[outcome]`` without any communication."""
    if outcome not in (LOADED, RETURNED_FALSE, RAISED):
        raise ValueError(f"outcome {outcome!r}: one of LOADED, RETURNED_FALSE, RAISED")
    tp = tensor_parallel_size(worker)
    if tp == 1:
        return [outcome]
    from vllm.distributed import get_tp_group

    group = get_tp_group()  # asserts when vLLM has not made it: a worker of a TP engine has
    if group.world_size != tp:
        raise RuntimeError(
            f"vLLM's tensor-parallel group has {group.world_size} ranks, the engine's config "
            f"{tp}: cannot agree on the refit across its ranks"
        )
    flags = torch.zeros(tp, dtype=torch.int64)
    flags[group.rank_in_group] = outcome
    torch.distributed.all_reduce(flags, group=group.cpu_group)
    return [int(f) for f in flags]


def failed_ranks(outcomes: list[int]) -> list[int]:
    """The ranks whose refit did not load."""
    return [r for r, o in enumerate(outcomes) if o != LOADED]
