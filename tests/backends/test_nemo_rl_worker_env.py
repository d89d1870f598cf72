"""The vLLM workers' plugin variables judged before Ray (`worker_env.worker_env_problems`) as vLLM
itself parses them.

vLLM 0.20 and 0.25 (``envs.py``) split ``VLLM_PLUGINS`` / ``VLLM_DISABLED_KERNELS`` on "," and
strip nothing; the plugin loader (``plugins/__init__.py``) keeps a plugin only when its name is in
that list. So ``VLLM_PLUGINS="nemo_jetrl, nemo_jetrl_nemo_rl_refit"`` loads our kernel plugin and
skips the refit hook. The check before Ray stripped the spaces and let it through; the run then
started Ray, loaded the model and started vLLM before the engine check (which splits as vLLM
does) stopped it (found by reading vLLM's ``envs.py``, 2026-12-02). With the real vLLM installed
(the NeMo-RL tier) its own parse is the reference.
"""

from __future__ import annotations

import pytest

from nemo_jetrl.backends.nemo_rl.engine_check import REFIT_PLUGIN
from nemo_jetrl.backends.nemo_rl.translate import _vllm_env, _vllm_patch_json
from nemo_jetrl.backends.nemo_rl.worker_env import worker_env_problems
from nemo_jetrl.recipe import Recipe
from nemo_jetrl.vllm_patch.guard import PLUGIN_NAME
from nemo_jetrl.vllm_patch.settings import KERNEL_NAME

ENV = _vllm_env({}, _vllm_patch_json(Recipe.preset("jetrl"), 2))
SPACED = f"{PLUGIN_NAME}, {REFIT_PLUGIN}"  # what vLLM reads as [PLUGIN_NAME, " " + REFIT_PLUGIN]


def test_a_plugin_name_with_a_space_is_refused_before_ray_as_vllm_skips_it():
    (problem,) = worker_env_problems({}, {**ENV, "VLLM_PLUGINS": SPACED}, True)
    assert problem.startswith(f"VLLM_PLUGINS={SPACED!r} does not list {REFIT_PLUGIN!r}")
    assert "policy.generation.vllm_cfg.env_vars.VLLM_PLUGINS" in problem
    assert "keeps spaces" in problem
    # the kernel plugin behind a space, set in the launch environment
    (kernel,) = worker_env_problems({"VLLM_PLUGINS": f"{REFIT_PLUGIN}, {PLUGIN_NAME}"}, ENV, True)
    assert f"does not list {PLUGIN_NAME!r}" in kernel and "keeps spaces" in kernel
    assert "VLLM_PLUGINS in the launch environment" in kernel
    ok = f"{PLUGIN_NAME},{REFIT_PLUGIN}"
    assert worker_env_problems({}, {**ENV, "VLLM_PLUGINS": ok}, True) == []


def test_a_disabled_kernel_behind_a_space_is_not_disabled_by_vllm_nor_refused():
    env = {**ENV, "VLLM_DISABLED_KERNELS": f"SomeKernel, {KERNEL_NAME}"}
    assert worker_env_problems({}, env, True) == []
    (problem,) = worker_env_problems({}, {**ENV, "VLLM_DISABLED_KERNELS": KERNEL_NAME}, True)
    assert f"names {KERNEL_NAME}" in problem


@pytest.mark.nemo_rl  # NeMo-RL's vLLM (0.20 / 0.25) is the reference; the default tier has none
@pytest.mark.parametrize(
    "plugins",
    [SPACED, f"{PLUGIN_NAME},{REFIT_PLUGIN}", f" {PLUGIN_NAME},{REFIT_PLUGIN}", "", PLUGIN_NAME],
)
def test_the_check_agrees_with_vllms_own_parse(monkeypatch, plugins):
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_PLUGINS", plugins)
    loaded = set(envs.VLLM_PLUGINS or ())  # what vLLM's plugin loader keeps, by exact name
    problems = worker_env_problems({"VLLM_PLUGINS": plugins}, ENV, True)
    assert any(f"does not list {PLUGIN_NAME!r}" in p for p in problems) == (
        PLUGIN_NAME not in loaded
    )
    assert any(f"does not list {REFIT_PLUGIN!r}" in p for p in problems) == (
        REFIT_PLUGIN not in loaded
    )


@pytest.mark.nemo_rl
@pytest.mark.parametrize("value", ["false", "", "true", " 0", "0", "1"])
def test_the_deepgemm_e8m0_check_agrees_with_vllms_own_read(monkeypatch, value):
    """vLLM reads ``VLLM_USE_DEEP_GEMM_E8M0`` with ``int()``: a value it cannot read is refused
    before Ray; one it reads as on is refused for re-quantizing; off passes."""
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_USE_DEEP_GEMM_E8M0", value)
    try:
        on: bool | None = bool(envs.VLLM_USE_DEEP_GEMM_E8M0)
    except ValueError:
        on = None
    problems = worker_env_problems({}, {**ENV, "VLLM_USE_DEEP_GEMM_E8M0": value}, True)
    assert any("reads it as an integer" in p for p in problems) == (on is None)
    assert any("re-quantizes every FP8 weight" in p for p in problems) == bool(on)
