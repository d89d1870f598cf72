"""Ray actor classes for tests/backends/test_nemo_rl_engine_check_ray.py, made by NeMo-RL's own
``RayWorkerBuilder`` inside NeMo-RL's ``RayWorkerGroup`` (which imports them by name in an
initializer actor, hence a module of their own, importable from the actors' ``PYTHONPATH``).

They stand in for NeMo-RL's vLLM generation actors only in what the engine check reads: ``llm``
(a vLLM engine whose ``collective_rpc(worker_status)`` returns fixed worker reports; the async
one's ``output_handler`` is a task on the actor's event loop, as vLLM's AsyncLLM has once
serving). The real engine behind NeMo-RL's real worker is test_nemo_rl_engine_check.py's.
"""

from __future__ import annotations

import asyncio

import ray


class _SyncLLM:
    def __init__(self, reports):
        self.reports = reports

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        from nemo_jetrl.backends.nemo_rl import engine_check as ec

        assert method is ec.worker_status
        return self.reports


class _AsyncLLM:
    def __init__(self, reports):
        self.reports = reports

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        from nemo_jetrl.backends.nemo_rl import engine_check as ec

        assert method is ec.worker_status
        await asyncio.sleep(0.5)
        return self.reports


@ray.remote
class SyncGen:
    def __init__(self, reports=None):
        self.llm = _SyncLLM(reports) if reports is not None else None

    def reset(self, reports):
        """This actor as a new one holding ``reports`` (its whole state: the check reads only
        ``llm`` and what it stores in ``__dict__``); each Ray actor is a ~10 s worker process."""
        self.__dict__.clear()
        self.__init__(reports)
        return True


@ray.remote
class AsyncGen:
    def __init__(self, reports=None):
        self.llm = _AsyncLLM(reports)

    async def start(self):
        """An async method: Ray runs this actor on an event loop. Like vLLM's AsyncLLM once
        serving, the engine's output handler is a task on that loop."""
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
