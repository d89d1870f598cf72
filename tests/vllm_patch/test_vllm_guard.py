"""The kernel guard against the real vLLM CPU build (0.32 or 0.20; scripts/test_vllm.sh).

Before start: this environment's real entry point passes; ``VLLM_DISABLED_KERNELS`` naming our
kernel and ``VLLM_PLUGINS`` without our plugin are refused by ``apply_patches`` (and by
``VllmRolloutEngine`` before any engine starts), leaving vLLM's registry as it was. After start:
a real engine's workers report every block-FP8 linear on our kernel; then one layer is forced to
another of vLLM's kernels inside the worker and the check names exactly that layer and shuts the
engine down. Finally our kernel disabled in the engine's environment only (the driver check
passed) never yields a silent engine: vLLM refuses to start or the post-start check names it.
"""

from __future__ import annotations

import os

import pytest
import torch
from vllm_fixtures import vllm_cpu_env

pytestmark = pytest.mark.vllm

KERNEL = "JetRLFp8BlockLinearKernel"


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_env():
    with vllm_cpu_env():
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hf_models import save_tiny_llama

    d = tmp_path_factory.mktemp("tiny_llama_guard")
    save_tiny_llama(d)
    return d


def _clean():
    from nemo_jetrl.vllm_patch.kernel import registered_kernel
    from nemo_jetrl.vllm_patch.settings import ENV_VAR

    return ENV_VAR not in os.environ and registered_kernel() is None


def test_this_environments_plugin_entry_point_passes():
    from nemo_jetrl.vllm_patch.guard import plugin_problems

    assert plugin_problems() == []


def test_disabled_kernel_refused_before_start_registry_untouched(monkeypatch):
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import KernelGuardError, apply_patches
    from nemo_jetrl.vllm_patch.kernel import fp8_block_registry

    before = {k: list(v) for k, v in fp8_block_registry().items()}
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", f"CutlassFp8BlockScaledMMKernel,{KERNEL}")
    with pytest.raises(KernelGuardError) as ei:
        apply_patches(Recipe.preset("jetrl"))
    assert f"VLLM_DISABLED_KERNELS='CutlassFp8BlockScaledMMKernel,{KERNEL}' names {KERNEL}" in (
        str(ei.value)
    )
    assert _clean() and {k: list(v) for k, v in fp8_block_registry().items()} == before
    # A BF16 rollout runs no block-FP8 linear: nothing to refuse.
    apply_patches(Recipe.preset("bf16")).revert()
    assert _clean()


def test_vllm_plugins_without_ours_refused_with_ours_accepted(monkeypatch):
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import KernelGuardError, apply_patches

    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    with pytest.raises(KernelGuardError, match="VLLM_PLUGINS='some_other_plugin' does not list"):
        apply_patches(Recipe.preset("jetrl"))
    assert _clean()
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin,nemo_jetrl")
    with apply_patches(Recipe.preset("jetrl")) as handle:
        assert handle.active
    assert _clean()


def test_rollout_engine_refuses_disabled_kernel_before_any_engine(model_dir, monkeypatch):
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import KernelGuardError, VllmRolloutEngine

    def no_engine(*a, **kw):
        raise AssertionError("vllm.LLM must not be started")

    monkeypatch.setattr("vllm.LLM", no_engine)
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", KERNEL)
    with pytest.raises(KernelGuardError, match=f"remove {KERNEL} from VLLM_DISABLED_KERNELS"):
        VllmRolloutEngine(model_dir, Recipe.preset("jetrl"), engine_kwargs={"dtype": "bfloat16"})
    assert _clean()


def _force_other_kernel(llm, layer: str) -> str:
    """In the worker, replace ``layer``'s kernel by one of vLLM's own block-FP8 kernel classes
    (the mutation the post-start check must catch); returns that class's name."""

    def force(worker, layer_name):  # runs in the worker (a closure: sent by value)
        from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS
        from vllm.platforms import PlatformEnum

        other = _POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CUDA][-1]  # present in every line
        runner = worker.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        model.get_submodule(layer_name).quant_method.fp8_linear = object.__new__(other)
        return other.__name__

    return llm.collective_rpc(force, args=(layer,))[0]


def test_post_start_check_passes_then_names_a_layer_forced_to_another_kernel(
    model_dir, monkeypatch
):
    from test_vllm_engine import USER_KWARGS

    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import KernelNotInEffect, VllmRolloutEngine, verify_engine_kernels

    # Lets the test send the mutation above as a function (test-only: vLLM then unpickles).
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    eng = VllmRolloutEngine(
        model_dir, Recipe.preset("jetrl"), engine_kwargs=USER_KWARGS, initial_refit=False
    )
    try:
        # The engine passed verify_engine_kernels at start; its report holds every FP8 linear.
        layers = eng.kernel_report["layers"]
        assert len(layers) == 8 and all(v["ours"] for v in layers.values()), layers
        assert {v["kernel"] for v in layers.values()} == {KERNEL}
        assert eng.kernel_report["registered"] and eng.kernel_report["env"]["NEMO_JETRL_VLLM_PATCH"]
        victim = "model.layers.1.mlp.down_proj"
        other = _force_other_kernel(eng.llm, victim)
        assert other != KERNEL
        with pytest.raises(KernelNotInEffect) as ei:
            verify_engine_kernels(eng.llm, eng.settings)
        msg = str(ei.value)
        assert f"1 of 8 block-FP8 linears run {other}, not {KERNEL}: {victim} " in msg
        assert "it was shut down" in msg
        with pytest.raises(Exception):  # noqa: B017 - any error: the engine is gone
            eng.llm.collective_rpc("jetrl_kernel_report", timeout=30)
    finally:
        eng.llm = None  # already shut down by the guard
        eng.close()
    assert _clean()


def test_kernel_disabled_in_the_engine_only_never_runs_silently(model_dir, monkeypatch, capfd):
    """The driver's check passed; the engine processes inherit VLLM_DISABLED_KERNELS naming our
    kernel (as a Ray runtime_env could do). Either vLLM finds no other kernel and refuses to start
    (this CPU without AMX: its message names our kernel as disabled), or it runs its own and the
    post-start check shuts it down naming the layers and the worker's variable."""
    import vllm
    from test_vllm_engine import USER_KWARGS
    from vllm import LLM

    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import (
        KernelNotInEffect,
        apply_patches,
        build_engine_kwargs,
        verify_engine_kernels,
    )
    from nemo_jetrl.vllm_patch.compat import release
    from nemo_jetrl.vllm_patch.shutdown import undo_failed_start

    recipe = Recipe.preset("jetrl")
    kw = build_engine_kwargs(recipe, USER_KWARGS).kwargs
    vllm_has_a_kernel = release(vllm.__version__) >= (0, 21, 0) and (
        torch.cpu._is_amx_tile_supported()
    )
    with apply_patches(recipe) as handle:
        monkeypatch.setenv("VLLM_DISABLED_KERNELS", KERNEL)
        if vllm_has_a_kernel:  # AMX CPU, vLLM >= 0.25: vLLM's own CPU kernel runs
            llm = LLM(model=str(model_dir), **kw)
            with pytest.raises(KernelNotInEffect) as ei:
                verify_engine_kernels(llm, handle.settings)
            msg = str(ei.value)
            assert "8 of 8 block-FP8 linears run" in msg
            assert f"the worker has VLLM_DISABLED_KERNELS='{KERNEL}'" in msg
        else:
            with pytest.raises(Exception) as ei, undo_failed_start():  # vLLM 0.20 leaves BF16
                LLM(model=str(model_dir), **kw)  # as the default dtype (shutdown module)
            captured = capfd.readouterr()
            text = f"{ei.value!r}\n{captured.out}\n{captured.err}"
            assert f"{KERNEL} is disabled by environment variable" in text
    assert _clean()
