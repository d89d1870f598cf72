"""Every vLLM engine of a NeMo-RL run proves at start that our kernel serves every FP8 linear and
our refit hook is installed, or the run stops naming what is missing (issue 36;
``backends/nemo_rl/engine_check.py``).

What runs for real: NeMo-RL's own ``VllmGenerationWorkerImpl._create_engine`` (the tree under
test) builds ``vllm.LLM`` (vLLM's CPU build: 0.20 for v0.7.0, 0.25.1 for main) with NeMo-RL's
``init_fp8`` kwargs and its ``VllmInternalWorkerExtension``, engine core in-process as NeMo-RL
sets it; our code reaches the engine only as on the cluster: through the ``vllm.general_plugins``
entry points, armed by the env ``translate`` writes into ``policy.generation.vllm_cfg.env_vars``
(no ``apply_patches`` in this process). The check is ``check_in_generation_worker`` (what the
driver runs in each generation actor) and ``prove_generation_engines`` (the driver), logging
through our ``JetrlLoggerProxy`` into NeMo-RL's real ``Logger`` (TensorBoard), read back by
``runs/logs.py``.

STAND-INS: the worker group (tests/backends/worker_group_shape.py: NeMo-RL's call contract and
its keywords-only assert, signature compared with the real one) runs Ray's ``__ray_call__`` in
this process, because the engine is started here, in the test's process, where the test can
reach its layers; the actor is the real class made without its ``__init__`` (GPU placement,
ports); CUDA-only pieces of NeMo-RL's worker come from ``standins/jetrl_nrl_worker_standin.py``
(also a vLLM plugin, so ``VLLM_PLUGINS`` naming only it keeps ours out).

On 696f711 nothing checked a NeMo-RL engine: without our plugins it started and served with
vLLM's kernel and NeMo-RL's refit quantizer, and no line or metric said whether ours ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
from hf_models import save_tiny_llama
from nemo_rl_upstream import nemo_rl_vllm_modules
from worker_group_shape import CallShapeWorkerGroup, get_raising

from nemo_jetrl.backends.nemo_rl import engine_check as ec
from nemo_jetrl.backends.nemo_rl.translate import VLLM_PATCH_ENV

pytestmark = [pytest.mark.nemo_rl, pytest.mark.vllm]

STANDINS = Path(__file__).resolve().parent / "standins"
NUM_LAYERS = 2
ENGINE_KWARGS = dict(
    dtype="bfloat16", max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=0
)


def run_vllm_env() -> dict[str, str]:
    """The vLLM env ``translate`` writes for recipe jetrl (patch settings + refit hook)."""
    from nemo_jetrl.backends.nemo_rl.translate import _vllm_env, _vllm_patch_json
    from nemo_jetrl.recipe import Recipe

    return _vllm_env({}, _vllm_patch_json(Recipe.preset("jetrl"), NUM_LAYERS))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("nrl_llama")
    save_tiny_llama(d)
    return d


def _unregister_ours() -> None:
    """Our kernel out of this process's registry (the plugin registers it without a handle)."""
    from nemo_jetrl.backends.nemo_rl import vllm_refit
    from nemo_jetrl.vllm_patch.experts import uninstall_moe_method
    from nemo_jetrl.vllm_patch.kernel import unregister_kernel

    unregister_kernel()
    uninstall_moe_method()
    if vllm_refit._PLUGIN_HANDLE is not None:
        vllm_refit._PLUGIN_HANDLE.revert()
        vllm_refit._PLUGIN_HANDLE = None


@contextlib.contextmanager
def nemo_rl_generation_worker(d: Path, env: dict[str, str]):
    """NeMo-RL's generation worker (real class, no __init__) whose engine its own
    ``_create_engine`` started in an environment holding ``env``; all undone on exit."""
    from vllm_fixtures import vllm_cpu_env

    from nemo_jetrl.vllm_patch.shutdown import shutdown_engine

    vllm_backend, fp8, _ = nemo_rl_vllm_modules()
    vllm_worker = importlib.import_module("nemo_rl.models.generation.vllm.vllm_worker")
    mp = pytest.MonkeyPatch()
    with vllm_cpu_env():
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as NeMo-RL's configure_worker
        # init_fp8 sets NeMo-RL's module globals and the in-process engine torch's default dtype:
        # restored on exit, or later tests of the tier see this engine's FP8 config (seen: the
        # fp32-scale quantizer tests found no difference, test_loss got a bf16 default dtype).
        for name in ("global_fp8_config", "fp8_patches_applied"):
            mp.setattr(fp8, name, getattr(fp8, name))
        mp.setattr(fp8, "fp8_state", fp8.FP8State())  # its caches fill in place: a fresh one
        default_dtype = torch.get_default_dtype()
        cfg = {"precision": "fp8", "kv_cache_dtype": "auto", "async_engine": False}
        nrl_kwargs = fp8.init_fp8(cfg, str(d), 1)  # NeMo-RL's own patches and kwargs
        standin = {"fp8": dataclasses.asdict(fp8.global_fp8_config), "device_id": "jetrl-ec"}
        mp.setenv("JETRL_NRL_WORKER_STANDIN", json.dumps(standin))
        from vllm.model_executor.layers import utils as layer_utils
        from vllm.v1.worker.cpu_worker import CPUWorker

        for owner, name in (  # what the stand-in plugin replaces in this process
            (layer_utils, "dispatch_cpu_unquantized_gemm"),
            (vllm_backend, "rebuild_cuda_tensor_from_ipc"),
            (vllm_backend.VllmInternalWorkerExtension, "report_device_id"),
            (CPUWorker, "init_device"),
        ):
            mp.setattr(owner, name, getattr(owner, name))
        import vllm.plugins

        mp.setattr(vllm.plugins, "plugins_loaded", False)  # load again for this engine
        mp.setenv("PYTHONPATH", os.pathsep.join([str(STANDINS), os.environ.get("PYTHONPATH", "")]))
        mp.syspath_prepend(str(STANDINS))
        for k, v in env.items():
            mp.setenv(k, v)
        _unregister_ours()
        actor = object.__new__(vllm_worker.VllmGenerationWorkerImpl)
        try:
            actor._create_engine(
                dict(
                    model=str(d),
                    load_format="dummy",
                    worker_extension_cls=f"{vllm_backend.__name__}.VllmInternalWorkerExtension",
                    **{**ENGINE_KWARGS, **nrl_kwargs},
                )
            )
            yield actor
        finally:
            _unregister_ours()
            for p in fp8.fp8_state.vllm_patches:
                p.stop()
            fp8.fp8_state.vllm_patches.clear()
            fp8.fp8_patches_applied = False
            llm = actor.__dict__.pop("llm", None)
            if llm is not None:
                shutdown_engine(llm)
            del llm
            gc.collect()
            mp.undo()
            torch.set_default_dtype(default_dtype)


def nemo_rl_logger(log_dir: Path):
    from nemo_rl.utils.logger import Logger

    from nemo_jetrl.backends.nemo_rl.metrics import JetrlLoggerProxy

    cfg = dict(
        log_dir=str(log_dir),
        wandb_enabled=False,
        swanlab_enabled=False,
        tensorboard_enabled=True,
        mlflow_enabled=False,
        monitor_gpus=False,
        tensorboard={},
        wandb={},
    )
    return JetrlLoggerProxy(Logger(cfg))


def _force_vllm_kernel(llm, layer: str) -> str:
    """In the worker, give ``layer`` one of vLLM's own block-FP8 kernel classes (what vLLM picks
    on a GPU without our plugin: CUTLASS; its CPU build has none of its own); returns its name."""

    def force(worker, layer_name):  # runs in the worker (a closure: sent by value)
        from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS
        from vllm.platforms import PlatformEnum

        other = _POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CUDA][-1]
        runner = worker.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        model.get_submodule(layer_name).quant_method.fp8_linear = object.__new__(other)
        return other.__name__

    return llm.collective_rpc(force, args=(layer,))[0]


# Each engine test below starts its own engine: vLLM reads VLLM_PLUGINS once, at engine start,
# and each test's claim is about the engine a different plugin set starts (none shareable).


# Own engine: started WITHOUT our refit hook's entry point (then its kernel is swapped by hand).
def test_without_our_refit_plugin_the_run_stops_naming_it(model_dir, tmp_path, monkeypatch):
    """``VLLM_PLUGINS`` without our refit hook's entry point (as in a venv whose nemo_jetrl lost
    it): the engine starts, our check stops the run naming the hook and the variable; then a
    layer on vLLM's own kernel is named too (the GPU case of a missing kernel plugin)."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the test's closure only
    env = {**run_vllm_env(), "VLLM_PLUGINS": "jetrl_nrl_worker_standin,nemo_jetrl"}
    with nemo_rl_generation_worker(model_dir, env) as actor:
        gen = type("Gen", (), {"worker_group": CallShapeWorkerGroup([actor])})()
        logger = nemo_rl_logger(tmp_path / "logs")
        with pytest.raises(ec.EngineNotProven) as ei:
            ec.prove_generation_engines(gen, run_vllm_env(), logger, get=get_raising)
        msg = str(ei.value)
        assert "the run stops before its first step" in msg
        assert "worker 0: our refit hook is not installed" in msg
        plugins = "VLLM_PLUGINS='jetrl_nrl_worker_standin,nemo_jetrl'"
        assert f"the worker has {plugins} without 'nemo_jetrl_nemo_rl_refit'" in msg
        assert "block-FP8 linears run" not in msg  # the kernel plugin did run: ours everywhere
        victim = "model.layers.1.mlp.down_proj"
        other = _force_vllm_kernel(actor.llm, victim)
        with pytest.raises(ec.EngineNotProven) as ei:
            ec.check_in_generation_worker(actor, env[VLLM_PATCH_ENV], False)
        assert f"worker 0: 1 of {4 * NUM_LAYERS} block-FP8 linears run {other}, not" in str(
            ei.value
        )
        assert victim in str(ei.value)
    from nemo_jetrl.runs.logs import read_run

    assert ec.FRACTION_METRIC not in read_run(tmp_path / "logs").scalars  # nothing proven


# Own engine: started WITHOUT our kernel's entry point (on most CPUs vLLM refuses to start).
def test_without_our_kernel_plugin_the_engine_never_runs_silently(model_dir, capfd):
    """``VLLM_PLUGINS`` without our kernel's entry point: vLLM's CPU build has no block-FP8
    kernel of its own on most CPUs and refuses to start; where it has one (vLLM 0.25 on AMX) it
    starts and our check names every layer and the variable. Never a silent engine."""
    env = {**run_vllm_env(), "VLLM_PLUGINS": "jetrl_nrl_worker_standin,nemo_jetrl_nemo_rl_refit"}
    with contextlib.ExitStack() as stack:
        try:
            actor = stack.enter_context(nemo_rl_generation_worker(model_dir, env))
        except Exception as exc:  # vLLM refused to start: no block-FP8 kernel for this CPU
            cap = capfd.readouterr()
            text = f"{exc!r}\n{cap.out}\n{cap.err}"
            # vLLM 0.20: no CPU entry in its registry (raised in this process with the worker
            # here, `uni`; printed by a spawned one); 0.25 without AMX: its CPU kernel refuses
            assert re.search(r"KeyError(: |\()<PlatformEnum\.CPU", text) or (
                "Failed to find a kernel that can implement the ScaledMM" in text
            ), exc
            return
        with pytest.raises(ec.EngineNotProven) as ei:
            ec.check_in_generation_worker(actor, env[VLLM_PATCH_ENV], True)
    msg = str(ei.value)
    n = 4 * NUM_LAYERS
    assert f"worker 0: {n} of {n} block-FP8 linears run" in msg
    assert "the worker has VLLM_PLUGINS='jetrl_nrl_worker_standin,nemo_jetrl_nemo_rl_refit'" in msg


# The positive case (both plugins: the line in the worker, the actor and the driver, the metric
# at step 0 in NeMo-RL's Logger) runs in every rehearsal of our recipes, through NeMo-RL's real
# RayWorkerGroup and grpo_train: tests/backends/rehearsals.assert_ready.


def test_a_recipe_whose_rollout_is_not_ours_is_not_checked():
    """bf16 / fp8_rollout: no NEMO_JETRL_VLLM_PATCH, vLLM's own kernels by design."""
    gen = type("Gen", (), {"worker_group": None})()
    assert ec.prove_generation_engines(gen, {}, None) is None
