"""Stopping a ``vllm.LLM``'s engine: its core and workers, and nothing left behind to hang.

The call is the same in every supported line (``llm_engine.engine_core.shutdown()``). One case
needs more: an engine core running in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
as NeMo-RL's generation worker and our tests run it) whose executor still spawns its workers
(vLLM 0.20's CPU platform turns ``uni`` into ``mp``). That executor talks to them through
message queues whose ZMQ sockets are never closed by its ``shutdown`` and linger forever: when
garbage collection later destroys their context, ``Context.term`` waits on them for good (seen:
a test module's teardown hung there on vLLM 0.20). Their sockets are closed here, without
lingering, once the workers are gone. With the engine core in its own process, or with the
``uni`` executor (vLLM 0.25+ with multiprocessing off, and 0.20 with `uni_executor`), there are
none in this process.

A ``uni`` executor's worker is shut down in the caller's process too, and vLLM 0.20's model
runner starts its shutdown with ``torch.accelerator.synchronize()``. With no accelerator (the
CUDA build of torch that vLLM 0.20's CPU install brings, on a machine without a GPU) that call
raises before anything is released, and the next engine in the process met the first one's
half torn-down state. There is nothing to wait for without an accelerator: for the length of the
shutdown the call does nothing (`_no_accelerator_sync`), and only then. (vLLM 0.25+'s CPU model
runner makes it a no-op itself, for good, when it is built: ``_set_torch_accelerator_to_noop``.)

Such a worker also builds vLLM's model-parallel groups in the caller's process. vLLM 0.25+'s
engine core tears them down at the end of its shutdown (``cleanup_dist_env_and_memory``, which
also drops vLLM's cache of its environment variables); 0.20's leaves them, and the next engine in
the process found them initialised and skipped building its own (a MoE engine after a dense one:
"expert parallel group is not initialized"; a ``VLLM_*`` variable set in between not read).
`shutdown_engine` makes the same call when the worker ran here and the groups outlived the
shutdown, and only then.

A start that fails leaves state behind too (`undo_failed_start`). vLLM 0.20's loader builds the
model under ``set_default_torch_dtype(model dtype)``, which restores the old default only when
construction returns: when it raises (a kernel refused, a checkpoint tensor of the wrong shape),
the process's default dtype stays BF16, and every float tensor made after it without a dtype is
BF16 (seen: a test's float32 model built after a refused engine got other weights, and a MoE
logprob control moved from 0.040 to 0.606 nats). 0.25.1 does the same; 0.32 restores it in a
``finally``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _executor_queues(core: Any) -> list[Any]:
    """The message queues of an in-process engine core's executor (none for a core in its own
    process: the client has no ``engine_core``)."""
    executor = getattr(getattr(core, "engine_core", None), "model_executor", None)
    if executor is None:
        return []
    queues = [getattr(executor, "rpc_broadcast_mq", None), *getattr(executor, "response_mqs", [])]
    queues += [getattr(w, "worker_response_mq", None) for w in getattr(executor, "workers", [])]
    return [q for q in queues if q is not None]


def _worker_in_process(core: Any) -> bool:
    """Whether an engine core's worker runs in this process: vLLM's ``uni`` executor under an
    in-process core (a spawned core or spawned workers: False)."""
    executor = getattr(getattr(core, "engine_core", None), "model_executor", None)
    if executor is None:
        return False
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return isinstance(executor, UniProcExecutor)


def queue_sockets(queue: Any) -> list[Any]:
    """Every ZMQ socket a vLLM message queue (and its spin condition) holds, open or closed."""
    import zmq

    owners = [o for o in (queue, getattr(queue, "_spin_condition", None)) if o is not None]
    return [v for o in owners for v in vars(o).values() if isinstance(v, zmq.Socket)]


def close_queue_sockets(queue: Any) -> int:
    """Close, without lingering, every open socket of `queue_sockets`; returns how many."""
    open_ = [s for s in queue_sockets(queue) if not s.closed]
    for sock in open_:
        sock.close(linger=0)
    return len(open_)


@contextlib.contextmanager
def _no_accelerator_sync() -> Iterator[bool]:
    """``torch.accelerator.synchronize`` as a no-op while no accelerator is available (module
    docstring); yields whether it replaced it. With an accelerator, nothing changes."""
    import torch

    acc = getattr(torch, "accelerator", None)  # torch >= 2.6, as every vLLM that calls it
    if acc is None or acc.is_available():
        yield False
        return
    sync = acc.synchronize
    acc.synchronize = lambda device=None: None  # nothing runs asynchronously on the CPU
    try:
        yield True
    finally:
        acc.synchronize = sync


def shutdown_engine(llm: Any) -> None:
    """Stop a ``vllm.LLM``'s engine core and workers; an in-process core's queue sockets are
    closed after (module docstring)."""
    core = llm.llm_engine.engine_core
    queues = _executor_queues(core)  # before shutdown, which drops its references to them
    worker_here = _worker_in_process(core)
    with _no_accelerator_sync():
        core.shutdown()
    if worker_here:
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():  # vLLM 0.20: left for the next engine
            parallel_state.cleanup_dist_env_and_memory()
    for queue in queues:
        close_queue_sockets(queue)


@contextlib.contextmanager
def undo_failed_start() -> Iterator[None]:
    """Around an in-process engine start: if it raises, torch's default dtype is set back to what
    it was (module docstring) and vLLM's model-parallel groups that the failed start built in
    this process are released, so that a retry here starts clean; then the error propagates."""
    import torch

    dtype = torch.get_default_dtype()
    groups_before = _groups_initialised()
    try:
        yield
    except BaseException:
        torch.set_default_dtype(dtype)
        if not groups_before and _groups_initialised():
            from vllm.distributed import parallel_state

            parallel_state.cleanup_dist_env_and_memory()
        raise


def _groups_initialised() -> bool:
    from vllm.distributed import parallel_state

    return parallel_state.model_parallel_is_initialized()
