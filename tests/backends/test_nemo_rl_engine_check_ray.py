"""``engine_check`` through REAL Ray (the overlay's Ray 2.60, a local one-CPU instance): the driver
reaches NeMo-RL-shaped generation actors by ``__ray_call__`` as ``RayWorkerGroup.
run_all_workers_single_data`` calls a method (``getattr(actor_handle, name).remote(...)``), an
``EngineNotProven`` raised in an actor arrives named, and an ASYNC actor (NeMo-RL's
``VllmAsyncGenerationWorker`` kind): Ray runs ``__ray_call__`` off its event loop, so the check
sends the engine's RPC to the loop AsyncLLM runs on and waits for it.

Stand-ins: the actors' engines (``llm``: fixed worker reports in ``worker_status``'s shape; the
async one an ``output_handler`` task on the actor's loop, as vLLM's AsyncLLM has once serving;
the real vLLM engine through NeMo-RL's worker is tests/backends/test_nemo_rl_engine_check.py) and
the worker group (NeMo-RL's needs a GPU placement group), which calls Ray exactly as NeMo-RL's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_nemo_rl_engine_check_unit import ENV, report

from nemo_jetrl.backends.nemo_rl import engine_check as ec

pytestmark = pytest.mark.nemo_rl

HERE = Path(__file__).resolve().parent


class Group:
    """NeMo-RL's ``run_all_workers_single_data`` call shape on real actor handles."""

    def __init__(self, workers):
        self.workers = workers

    def run_all_workers_single_data(self, method_name, *args, run_rank_0_only_axes=None, **kw):
        return [getattr(w, method_name).remote(*args, **kw) for w in self.workers]


class SyncLLM:
    def __init__(self, reports):
        self.reports = reports

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method is ec.worker_status
        return self.reports


class AsyncLLM:
    def __init__(self, reports):
        self.reports = reports

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        import asyncio

        assert method is ec.worker_status
        await asyncio.sleep(0.5)
        return self.reports


class SyncGen:
    def __init__(self, reports):
        self.llm = SyncLLM(reports) if reports is not None else None

    def reset(self, reports):
        """This actor as a new one holding ``reports`` (its whole state: the check reads only
        ``llm`` and what it stores in ``__dict__``); each Ray actor is a ~10 s worker process."""
        self.__dict__.clear()
        self.__init__(reports)
        return True


class AsyncGen:
    def __init__(self, reports):
        self.llm = AsyncLLM(reports)

    async def start(self):
        """An async method: Ray runs this actor on an event loop. Like vLLM's AsyncLLM once
        serving, the engine's output handler is a task on that loop."""
        import asyncio

        self.llm.output_handler = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
        return True

    async def reset(self, reports, start=False):
        """This actor as a new one (SyncGen.reset), its old engine's output handler cancelled."""
        handler = getattr(self.llm, "output_handler", None)
        if handler is not None:
            handler.cancel()
        self.__dict__.clear()
        self.__init__(reports)
        return await self.start() if start else True


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    old = os.environ.get("PYTHONPATH", "")
    # the actors unpickle this module's classes by reference: its folder on their path
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), old])
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def actors(ray_local):
    """One real Ray actor of each kind (sync, async), reset to a new state for each case."""
    return {cls: ray_local.remote(cls).remote(None) for cls in (SyncGen, AsyncGen)}


def _gen(ray, actors, cls, reports, start=False):
    """NeMo-RL's generation (its worker group) over ``cls``'s actor, reset to hold ``reports``
    (and, ``start``: an engine loop serving)."""
    actor = actors[cls]
    args = (reports, start) if cls is AsyncGen else (reports,)
    assert ray.get(actor.reset.remote(*args))
    return type("G", (), {"worker_group": Group([actor])})()


def test_sync_actor_line_and_missing_engine(ray_local, actors, capsys):
    res = ec.prove_generation_engines(_gen(ray_local, actors, SyncGen, [report()]), ENV, None)
    assert (res["fp8_linears"], res["on_our_kernel"]) == (4, 4)
    bad = _gen(ray_local, actors, SyncGen, [report(hook=False)])
    with pytest.raises(ec.EngineNotProven, match="worker 0: our refit hook is not installed"):
        ec.prove_generation_engines(bad, ENV, None)
    with pytest.raises(ec.EngineNotProven, match="has no engine yet"):
        ec.prove_generation_engines(_gen(ray_local, actors, SyncGen, None), ENV, None)


def test_async_actor_is_checked_on_its_engines_event_loop(ray_local, actors, capsys):
    """Ray 2.60 runs ``__ray_call__`` of an async actor off its event loop: the check sends the
    RPC to the engine's loop and waits; before the engine has a loop it says NOT run."""
    gen = _gen(ray_local, actors, AsyncGen, [report(), report()], start=True)
    res = ec.prove_generation_engines(gen, ENV, None)
    assert res.get("async") is None, res
    assert (res["workers"], res["fp8_linears"], res["on_our_kernel"]) == (2, 8, 8)
    bad = _gen(ray_local, actors, AsyncGen, [report(ours=False)], start=True)
    with pytest.raises(ec.EngineNotProven, match="worker 0: 4 of 4 block-FP8 linears run"):
        ec.prove_generation_engines(bad, ENV, None)
    unstarted = _gen(ray_local, actors, AsyncGen, [report()])
    assert ec.prove_generation_engines(unstarted, ENV, None) == {"async": True}
    assert "engine check NOT run" in capsys.readouterr().out
