"""`nemo_jetrl.vllm_patch.shutdown` on this vLLM (vLLM tier: pyzmq comes with it): the queue
sockets of an in-process engine core are closed without lingering, so their context's ``term``
returns; the attributes it reads are the ones this vLLM's classes set. The engine-level proof
is tests/vllm_patch/test_vllm_dense_shards.py's last test (a TP=2 engine's queues)."""

from __future__ import annotations

import inspect
import threading
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm


def test_a_queues_sockets_are_closed_without_lingering_and_term_returns(tmp_path):
    import zmq

    from nemo_jetrl.vllm_patch.shutdown import close_queue_sockets

    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)  # a message queued for a peer that never comes
    push.connect(f"ipc://{tmp_path / 'gone'}")
    push.send(b"x" * 1024, zmq.NOBLOCK)
    notify = ctx.socket(zmq.PUB)
    queue = SimpleNamespace(local_socket=push, remote_socket=None, n_reader=1,
                            _spin_condition=SimpleNamespace(notify=notify))  # fmt: skip
    assert close_queue_sockets(queue) == 2 and push.closed and notify.closed
    assert close_queue_sockets(queue) == 0  # idempotent
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    assert done.wait(10), "Context.term still waits: a socket was left lingering"


def test_the_queues_of_an_in_process_core_are_found_and_a_client_without_one_has_none():
    from nemo_jetrl.vllm_patch.shutdown import _executor_queues

    a, b, c = object(), object(), object()
    executor = SimpleNamespace(rpc_broadcast_mq=a, response_mqs=[b],
                               workers=[SimpleNamespace(worker_response_mq=c)])  # fmt: skip
    assert _executor_queues(SimpleNamespace(engine_core=SimpleNamespace(model_executor=executor)))\
        == [a, b, c]  # fmt: skip
    uni = SimpleNamespace(driver_worker=object())  # the uni executor: no queues
    assert _executor_queues(SimpleNamespace(engine_core=SimpleNamespace(model_executor=uni))) == []
    assert _executor_queues(SimpleNamespace(resources=object())) == []  # core in its process


def test_the_attributes_read_are_the_ones_this_vllm_sets():
    """Read in this vLLM's source: the in-process client's ``engine_core``, the core's
    ``model_executor``, the multiprocess executor's queues and its workers' response queues."""
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.v1.engine import core, core_client
    from vllm.v1.executor import multiproc_executor

    assert "self.engine_core = EngineCore(" in inspect.getsource(core_client.InprocClient)
    assert "self.model_executor = " in inspect.getsource(core.EngineCore)
    executor = inspect.getsource(multiproc_executor.MultiprocExecutor)
    for attr in ("self.rpc_broadcast_mq = ", "self.response_mqs", "self.workers = "):
        assert attr in executor, attr
    assert "worker_response_mq" in inspect.getsource(multiproc_executor.WorkerProcHandle)
    queue = inspect.getsource(shm_broadcast.MessageQueue)
    assert "self.local_socket = context.socket(" in queue and "self._spin_condition" in queue


def test_the_worker_is_in_process_only_under_the_uni_executor_of_an_in_process_core():
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from nemo_jetrl.vllm_patch.shutdown import _worker_in_process

    uni = UniProcExecutor.__new__(UniProcExecutor)  # never started: only its class is read
    assert _worker_in_process(SimpleNamespace(engine_core=SimpleNamespace(model_executor=uni)))
    mp = SimpleNamespace(rpc_broadcast_mq=object(), response_mqs=[], workers=[])
    assert not _worker_in_process(SimpleNamespace(engine_core=SimpleNamespace(model_executor=mp)))
    assert not _worker_in_process(SimpleNamespace(resources=object()))  # core in its process


@pytest.mark.parametrize(
    ("worker_here", "groups_left", "cleaned"),
    [(True, True, 1), (True, False, 0), (False, True, 0)],
    ids=["uni-groups-left", "uni-groups-gone", "worker-elsewhere"],
)
def test_groups_a_worker_here_left_are_torn_down_after_its_shutdown(
    monkeypatch, worker_here, groups_left, cleaned
):
    """vLLM 0.20's engine core leaves an in-process worker's model-parallel groups (and its env
    cache) to the next engine; 0.25+ tear them down themselves. `shutdown_engine` calls vLLM's
    own ``cleanup_dist_env_and_memory`` after the core's shutdown, only where they remain."""
    from vllm.distributed import parallel_state

    from nemo_jetrl.vllm_patch import shutdown

    order = []
    monkeypatch.setattr(shutdown, "_worker_in_process", lambda core: worker_here)
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: groups_left)
    monkeypatch.setattr(parallel_state, "cleanup_dist_env_and_memory",
                        lambda shutdown_ray=False: order.append("cleanup"))  # fmt: skip
    core = SimpleNamespace(shutdown=lambda: order.append("shutdown"))
    shutdown.shutdown_engine(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core)))
    assert order == ["shutdown"] + ["cleanup"] * cleaned
