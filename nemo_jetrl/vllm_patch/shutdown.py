"""Stopping a ``vllm.LLM``'s engine: its core and workers, and nothing left behind to hang.

The call is the same in every supported line (``llm_engine.engine_core.shutdown()``). One case
needs more: an engine core running in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
as NeMo-RL's generation worker and our tests run it) whose executor still spawns its workers
(vLLM 0.20's CPU platform turns ``uni`` into ``mp``). That executor talks to them through
message queues whose ZMQ sockets are never closed by its ``shutdown`` and linger forever: when
garbage collection later destroys their context, ``Context.term`` waits on them for good (seen:
a test module's teardown hung there on vLLM 0.20). Their sockets are closed here, without
lingering, once the workers are gone. With the engine core in its own process, or with the
``uni`` executor (vLLM 0.25+ with multiprocessing off), there are none in this process.
"""

from __future__ import annotations

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


def shutdown_engine(llm: Any) -> None:
    """Stop a ``vllm.LLM``'s engine core and workers; an in-process core's queue sockets are
    closed after (module docstring)."""
    core = llm.llm_engine.engine_core
    queues = _executor_queues(core)  # before shutdown, which drops its references to them
    core.shutdown()
    for queue in queues:
        close_queue_sockets(queue)
