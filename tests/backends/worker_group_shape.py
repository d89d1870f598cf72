"""STAND-IN for NeMo-RL's ``RayWorkerGroup.run_all_workers_single_data`` where no Ray actor can
hold the actor under test: unit tests of the driver (fixed results) and the real vLLM engine
started in the test's own process (tests/backends/test_nemo_rl_engine_check.py).

It keeps the real method's contract, so a call NeMo-RL refuses is refused here too:

* the same signature (``method_name, *args, run_rank_0_only_axes=None, **kwargs``), compared with
  NeMo-RL's by ``test_nemo_rl_worker_group_shape.py`` (NeMo-RL tier, both trees);
* the same ``assert len(args) == 0`` (NeMo-RL ray.put()s each keyword's value; positional
  arguments "fail under certain circumstances", NVIDIA-NeMo/RL#582): the engine check passed its
  function positionally until the issue-46 reading found it; the stand-ins it was tested with
  took ``*args`` and let it through;
* Ray's ``__ray_call__(self, fn, *args, **kwargs)``: ``fn(actor, **kwargs)``.

Where a Ray actor can hold the object, tests use the real ``RayVirtualCluster(use_gpus=False)``
and ``RayWorkerGroup`` (tests/backends/test_nemo_rl_engine_check_ray.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# NeMo-RL's own words (v0.7.0 worker_groups.py:822, main-7ea279a :844), so a test can match them.
POSITIONAL_REFUSED = "run_all_workers_single_data will fail with args under certain circumstances"


def ray_call(actor: Any, method_name: str, kwargs: dict[str, Any]) -> Any:
    """What Ray runs in the actor for ``getattr(handle, method_name).remote(**kwargs)``."""
    if method_name == "__ray_call__":
        kw = dict(kwargs)
        fn = kw.pop("fn")
        return fn(actor, **kw)
    return getattr(actor, method_name)(**kwargs)


class CallShapeWorkerGroup:
    """``run_all_workers_single_data`` over in-process actors (or fixed ``results``).

    ``actors``: one object per engine leader; ``results``: returned instead of calling anything
    (a unit test of the driver's handling); ``call``: how to run one call (default: in this
    thread; the async test runs it on an event loop). An exception raised by a call is returned in
    its place, as Ray hands it to ``ray.get``.
    """

    def __init__(
        self,
        actors: Sequence[Any] = (),
        results: Sequence[Any] | None = None,
        call: Callable[[Any, str, dict[str, Any]], Any] = ray_call,
    ) -> None:
        self.actors = list(actors)
        self.results = results
        self.call = call
        self.calls: list[dict[str, Any]] = []

    def run_all_workers_single_data(
        self,
        method_name: str,
        *args: Any,
        run_rank_0_only_axes: list[str] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        assert len(args) == 0, (
            f"{POSITIONAL_REFUSED}. Please use kwargs instead. "
            "See https://github.com/NVIDIA-NeMo/RL/issues/582 for more details."
        )
        self.calls.append({"method": method_name, "axes": run_rank_0_only_axes, "kwargs": kwargs})
        if self.results is not None:
            return list(self.results)
        out = []
        for actor in self.actors:
            try:
                out.append(self.call(actor, method_name, kwargs))
            except Exception as exc:  # Ray raises it from ray.get: hand it over the same way
                out.append(exc)
        return out


def get_raising(futures: Sequence[Any]) -> list[Any]:
    """``ray.get`` over `CallShapeWorkerGroup`'s results: the first exception is raised."""
    for f in futures:
        if isinstance(f, Exception):
            raise f
    return list(futures)
