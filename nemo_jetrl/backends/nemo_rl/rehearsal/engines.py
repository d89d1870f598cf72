"""NeMo-RL's vLLM generation on this machine's CPU: the Ray it runs on, the worker Python, and
the generation settings a CPU engine needs, each applied as an explicit, revertible change.

* Ray: a local instance declaring ``gpus`` logical GPUs (``ray.init(num_gpus=...)``), so
  NeMo-RL's ``RayVirtualCluster`` (GPU placement groups: one GPU per worker) places its actors as
  on a node; nothing in them touches a GPU (vLLM's CPU build; `cpu_worker`). It stands in for
  NeMo-RL's ``init_ray``, which attaches to the cluster ``ray.sub`` started.
* Worker Python: NeMo-RL's actor registry names ``uv run --extra vllm`` (a venv it builds);
  the rehearsal runs every actor on this process's Python (what NeMo-RL's own
  ``NEMO_RL_PY_EXECUTABLES_SYSTEM=1`` selects, and what the image's prebuilt venvs are).
* Generation settings (`cpu_generation_overrides`): ``enable_prefix_caching`` set (NeMo-RL asks
  CUDA for the GPU's compute capability when it is unset; an H100 gets True), the KV cache in
  host memory (``VLLM_CPU_KVCACHE_SPACE``), no core pinning, and `cpu_worker`'s settings.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from nemo_jetrl.backends.nemo_rl.rehearsal.cpu_worker import ENV_VAR

# The actors a rehearsal starts (NeMo-RL's fully qualified names).
VLLM_WORKERS = (
    "nemo_rl.models.generation.vllm.vllm_worker.VllmGenerationWorker",
    "nemo_rl.models.generation.vllm.vllm_worker_async.VllmAsyncGenerationWorker",
)


def rehearsal_env(vllm_cfg: Mapping[str, Any], model: str, model_parallel_size: int) -> dict:
    """The variables a rehearsal adds to ``vllm_cfg.env_vars`` (user's own values kept)."""
    from nemo_jetrl.vllm_patch import cpu_fixes
    from nemo_jetrl.vllm_patch.compat import cpu_omp_threads_bind

    plain = {k: v for k, v in vllm_cfg.items() if k != "env_vars"}
    return {
        ENV_VAR: json.dumps(
            {
                "vllm_cfg": plain,
                "model": model,
                "model_parallel_size": model_parallel_size,
                "driver_pid": os.getpid(),
            },
            sort_keys=True,
        ),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_omp_threads_bind(),
        cpu_fixes.ENV: "1",  # vLLM's CPU build fixed in its processes (vllm_patch.cpu_fixes)
    }


def cpu_generation_overrides(
    generation: MutableMapping[str, Any], model: str, model_parallel: int
) -> None:
    """``policy.generation`` made to run on vLLM's CPU build, in place (see the module text);
    ``model``: what vLLM loads (``policy.model_name``)."""
    vllm_cfg = generation.setdefault("vllm_cfg", {})
    if vllm_cfg.get("enable_prefix_caching") is None:
        vllm_cfg["enable_prefix_caching"] = True  # what NeMo-RL picks on an H100
    env = dict(vllm_cfg.get("env_vars") or {})
    for k, v in rehearsal_env(vllm_cfg, str(model), model_parallel).items():
        env.setdefault(k, v)
    vllm_cfg["env_vars"] = env


@contextlib.contextmanager
def system_python_workers(registry: MutableMapping[str, str], python: str) -> Iterator[None]:
    """NeMo-RL's vLLM actors on ``python`` (its registry entries replaced, then restored)."""
    old = {k: registry[k] for k in VLLM_WORKERS if k in registry}
    for k in old:
        registry[k] = python
    try:
        yield
    finally:
        registry.update(old)


@contextlib.contextmanager
def local_ray(gpus: int, cpus: int | None = None) -> Iterator[Any]:
    """A local Ray declaring ``gpus`` logical GPUs (and ``cpus`` logical CPUs: default one per
    GPU plus two), shut down on exit. ``RAY_ADDRESS`` names it while it runs: NeMo-RL's memory
    tracker (main: ``memory_summary()`` at each stage) looks the cluster up by address, and
    refuses when another Ray runs on the machine (e.g. a second rehearsal)."""
    import os

    import ray

    ray.init(
        num_gpus=gpus,
        num_cpus=cpus if cpus is not None else gpus + 2,
        include_dashboard=False,
        log_to_driver=True,
    )
    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    try:
        yield ray
    finally:
        if old is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old
        ray.shutdown()
