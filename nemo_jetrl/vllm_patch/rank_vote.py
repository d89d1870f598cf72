"""Every rank of one vLLM engine agrees on a refit's outcome before any of them keeps it.

At vLLM ``tensor_parallel_size`` > 1 each rank's worker runs the refit on its own shards: NeMo-RL
calls the transport on every worker, and each one loads, checks parity on its part and, on a
failure, rolls its own shards back. Alone, that leaves an engine whose rank 0 holds the new
weights and whose rank 1 holds the old ones: a half-refit engine that a caught error would
roll out with. So after its own outcome is known each rank shares it over the engine's
tensor-parallel CPU group (one gloo all-reduce of ``tp`` integers, no GPU work) and every rank
then rolls back if any failed: all-or-nothing for the engine, not per rank.

Every rank reaches the vote, whatever happened to it, so the collective cannot be left waiting
by a rank that raised: the hook catches its errors first, and a rank that could not take its
rollback snapshot (out of memory there alone) drains its stream loading nothing and votes
RAISED. The ranks are those of one pipeline stage: with the parity check or rollback on, vLLM
``pipeline_parallel_size`` > 1 is refused before launch (``translate``) and in the hook.
(NeMo-RL runs each transport on every worker of an engine at once: its driver calls the
engine's ``collective_rpc``, which vLLM's Ray and mp executors send to all workers together.)
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from nemo_jetrl.vllm_patch.refit_kv import RefitError
from nemo_jetrl.vllm_patch.rollback import RollbackError, restore_snapshot, rolled_back

log = logging.getLogger(__name__)

LOADED, RETURNED_FALSE, RAISED = 0, 1, 2
"""A rank's outcome: kept the refit; the transport returned False (NeMo-RL caught its error);
our hook or the transport raised (refusal, parity failure)."""


CHECK_KEYS = ("jetrl.refit_parity_check", "jetrl.refit_rollback")
"""The refit checks whose ranks must agree, by their YAML keys (both default to on)."""


def checks_on(*, parity: bool, rollback: bool) -> list[str]:
    """The ``CHECK_KEYS`` that are on, for `stage_problem`."""
    return [k for k, on in zip(CHECK_KEYS, (parity, rollback), strict=True) if on]


def stage_problem(pp: object, checked: list[str]) -> str | None:
    """Why vLLM ``pipeline_parallel_size`` ``pp`` cannot run with the refit checks ``checked``
    (the ``jetrl.refit_*`` keys that are on): the vote covers one stage's tensor-parallel
    group, and each rank's parity reads its own stage's layers only. None: it can."""
    if not checked or not isinstance(pp, int) or pp <= 1:
        return None
    return (
        f"{pp}: the refit's parity check and all-or-nothing rollback ({', '.join(checked)}) "
        "work within one pipeline stage: set it to 1 (use tensor_parallel_size), or set "
        f"{' and '.join(checked)} to false"
    )


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


def settle(name: str, worker: Any, snap: Any, failure: Exception | None, ok: bool) -> bool:
    """After ``name`` ran on this rank (``failure`` raised, else returned ``ok``): True when
    every rank of the engine loaded the refit; else this rank is restored from ``snap`` and the
    refusal raised (this rank's, or one naming the ranks that raised), or False returned (a
    transport returned False, as NeMo-RL's does on its own errors). ``snap`` None: this rank
    could not take one and loaded nothing (its ``failure`` says so)."""
    mine = RAISED if failure is not None else outcome(ok)
    try:
        outcomes = engine_outcomes(worker, mine)
    except Exception as exc:
        state = "restored to before this refit" if snap is not None else "without a snapshot"
        if snap is not None:
            restore_snapshot(worker.model_runner.model, snap)
        raise RollbackError(
            f"the ranks of this engine could not agree on the refit ({type(exc).__name__}: "
            f"{exc}); this rank is {state}, the others' state is unknown: restart the engine"
            + (f" (this rank's refit had failed: {failure})" if failure is not None else "")
        ) from exc
    bad = failed_ranks(outcomes)
    if not bad:
        return True
    where = (
        f" on this rank; every rank that loaded restored its own: the refit failed on "
        f"tensor-parallel rank(s) {bad} of {len(outcomes)}"
        if len(outcomes) > 1
        else ""
    )
    if snap is None:  # nothing was loaded here (the snapshot's own failure)
        assert failure is not None
        raise RefitError(f"{failure}{where}") from failure
    restored = restore_snapshot(worker.model_runner.model, snap).tensors
    if failure is not None:
        raise rolled_back(failure, restored, where) from failure
    raised = [r for r, o in enumerate(outcomes) if o == RAISED]
    if raised:
        raise rolled_back(
            RefitError(
                f"refit refused on tensor-parallel rank(s) {raised} of this engine (their "
                "error says why); "
                + (
                    "this rank had loaded its part"
                    if mine == LOADED
                    else "this rank's transport had returned False"
                )
            ),
            restored,
            where,
        )
    log.error("%s failed; rolled the engine back (%d tensors%s)", name, restored, where)
    return False
