"""``engine_check`` through REAL Ray and NeMo-RL's REAL worker group on CPU: NeMo-RL's
``RayVirtualCluster(use_gpus=False)`` (CPU placement groups on a local Ray) and its
``RayWorkerGroup`` of actors built by its ``RayWorkerBuilder``, sharded as ``VllmGeneration``
shards its engines (data, pipeline, tensor parallel axes). The driver's check goes through
NeMo-RL's own ``run_all_workers_single_data`` (keywords only: it asserts that no positional
argument follows the method name, the crash of issue 46 that a hand-made group let through),
reaches each engine's leader by ``__ray_call__``, and an ``EngineNotProven`` raised in an actor
arrives named. An ASYNC actor (NeMo-RL's ``VllmAsyncGenerationWorker`` kind): Ray runs
``__ray_call__`` off its event loop, so the check sends the engine's RPC to the loop AsyncLLM runs
on and waits for it.

Stand-ins: the actors' engines only (tests/backends/nemo_rl_check_actors.py: fixed worker reports
in ``worker_status``'s shape); the real vLLM engine through NeMo-RL's worker is
tests/backends/test_nemo_rl_engine_check.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from test_nemo_rl_engine_check_unit import ENV, report

from nemo_jetrl.backends.nemo_rl import engine_check as ec

pytestmark = pytest.mark.nemo_rl

HERE = Path(__file__).resolve().parent
ACTORS = "nemo_rl_check_actors"
AXES = ["data_parallel", "pipeline_parallel", "tensor_parallel"]


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    old = os.environ.get("PYTHONPATH", "")
    # the actors are imported by name in NeMo-RL's initializer actor: their folder on the path
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), old])
    # logical CPUs: one per placement-group bundle (NeMo-RL reserves one per worker)
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def groups(ray_local):
    """NeMo-RL's real worker groups: a sync engine of tensor-parallel size 2 (two workers, the
    check must reach its leader only) and an async engine of one worker."""
    from nemo_rl.distributed.named_sharding import NamedSharding
    from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES, RayVirtualCluster
    from nemo_rl.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup

    made, clusters = {}, []
    try:
        for name, tp in (("SyncGen", 2), ("AsyncGen", 1)):
            fqn = f"{ACTORS}.{name}"
            ACTOR_ENVIRONMENT_REGISTRY[fqn] = PY_EXECUTABLES.SYSTEM
            cluster = RayVirtualCluster(
                bundle_ct_per_node_list=[tp], use_gpus=False, name=f"jetrl-check-{name}"
            )
            clusters.append(cluster)
            sharding = NamedSharding(layout=np.arange(tp).reshape(1, 1, tp), names=AXES)
            made[name] = RayWorkerGroup(
                cluster,
                RayWorkerBuilder(fqn),
                name_prefix=f"jetrl-check-{name}",
                sharding_annotations=sharding,
            )
        yield made
    finally:
        for group in made.values():
            group.shutdown(force=True)
        for cluster in clusters:
            cluster.shutdown()
        for name in ("SyncGen", "AsyncGen"):
            ACTOR_ENVIRONMENT_REGISTRY.pop(f"{ACTORS}.{name}", None)


def _gen(ray, groups, name, reports, start=False):
    """NeMo-RL's generation (its real worker group), every actor reset to hold ``reports`` (and,
    ``start``: an engine loop serving)."""
    group = groups[name]
    args = (reports, start) if name == "AsyncGen" else (reports,)
    assert all(ray.get([w.reset.remote(*args) for w in group.workers]))
    return type("G", (), {"worker_group": group})()


def test_nemo_rls_worker_group_refuses_positional_arguments(ray_local, groups):
    """The call shape the engine check used on fd6dbfb, refused by NeMo-RL's own group."""
    with pytest.raises(AssertionError, match="Please use kwargs instead"):
        groups["SyncGen"].run_all_workers_single_data(
            "__ray_call__", ec.check_in_generation_worker, "{}", True
        )


def test_sync_actor_line_and_missing_engine(ray_local, groups, capsys):
    res = ec.prove_generation_engines(_gen(ray_local, groups, "SyncGen", [report()]), ENV, None)
    # two tensor-parallel workers, one engine: its leader alone answers
    assert (res["engines"], res["fp8_linears"], res["on_our_kernel"]) == (1, 4, 4)
    bad = _gen(ray_local, groups, "SyncGen", [report(hook=False)])
    with pytest.raises(ec.EngineNotProven, match="worker 0: our refit hook is not installed"):
        ec.prove_generation_engines(bad, ENV, None)
    with pytest.raises(ec.EngineNotProven, match="has no engine yet"):
        ec.prove_generation_engines(_gen(ray_local, groups, "SyncGen", None), ENV, None)


def test_async_actor_is_checked_on_its_engines_event_loop(ray_local, groups, capsys):
    """Ray 2.60 runs ``__ray_call__`` of an async actor off its event loop: the check sends the
    RPC to the engine's loop and waits; before the engine has a loop it says NOT run."""
    gen = _gen(ray_local, groups, "AsyncGen", [report(), report()], start=True)
    res = ec.prove_generation_engines(gen, ENV, None)
    assert res.get("async") is None, res
    assert (res["workers"], res["fp8_linears"], res["on_our_kernel"]) == (2, 8, 8)
    bad = _gen(ray_local, groups, "AsyncGen", [report(ours=False)], start=True)
    with pytest.raises(ec.EngineNotProven, match="worker 0: 4 of 4 block-FP8 linears run"):
        ec.prove_generation_engines(bad, ENV, None)
    unstarted = _gen(ray_local, groups, "AsyncGen", [report()])
    assert ec.prove_generation_engines(unstarted, ENV, None) == {"async": True}
    assert "engine check NOT run" in capsys.readouterr().out
