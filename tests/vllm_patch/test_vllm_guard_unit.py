"""The kernel guard's decisions that need no vLLM (vllm_patch/guard.py): engine kwargs, plugin
entry points, vLLM's kernel/plugin variables, and the analysis of the workers' kernel reports.

The engine-side halves (real entry points, real vLLM variables, a real engine's report and a
mutated layer) are in test_vllm_guard.py.
"""

from __future__ import annotations

import dataclasses
import sys
from importlib.metadata import EntryPoint

import pytest

from nemo_jetrl.errors import UserError
from nemo_jetrl.recipe import Recipe
from nemo_jetrl.vllm_patch import EngineArgsConflict, build_engine_kwargs, settings_from_recipe
from nemo_jetrl.vllm_patch.guard import (
    PLUGIN_GROUP,
    PLUGIN_NAME,
    PLUGIN_TARGET,
    KernelGuardError,
    KernelNotInEffect,
    env_problems,
    kernel_problems,
    plugin_problems,
)
from nemo_jetrl.vllm_patch.settings import ENV_VAR

JETRL = Recipe.preset("jetrl")
KERNEL = "JetRLFp8BlockLinearKernel"


# -- engine kwargs: --linear-backend and its kernel_config forms -------------------------------


@pytest.mark.parametrize(
    ("user", "named"),
    [
        ({"linear_backend": "cutlass"}, "linear_backend: you set 'cutlass'"),
        ({"linear_backend": "deep-gemm"}, "linear_backend: you set 'deep-gemm'"),
        ({"kernel_config": {"linear_backend": "triton"}}, "kernel_config.linear_backend"),
        (
            {"kernel_config": {"linear_backend_per_quant": {"fp8_block_w8a8": "cutlass"}}},
            "kernel_config.linear_backend_per_quant.fp8_block_w8a8",
        ),
    ],
)
def test_engine_kwargs_refuse_a_linear_backend_other_than_auto(user, named):
    with pytest.raises(EngineArgsConflict) as ei:
        build_engine_kwargs(JETRL, user)
    assert named in str(ei.value) and "_resolve_backend_kernels" in str(ei.value)


def test_engine_kwargs_linear_backend_auto_and_other_quant_schemes_pass():
    for user in (
        {"linear_backend": "auto"},
        {"linear_backend": "AUTO"},  # vLLM lower-cases it
        {"kernel_config": {"linear_backend_per_quant": {"nvfp4_w4a16": "humming"}}},
    ):
        assert build_engine_kwargs(JETRL, user).kwargs.items() >= user.items()
    # A BF16 rollout has no block-FP8 linears: the backend is the user's business.
    bf16 = build_engine_kwargs(Recipe.preset("bf16"), {"linear_backend": "cutlass"})
    assert bf16.kwargs["linear_backend"] == "cutlass"


def test_engine_kwargs_report_backend_with_other_conflicts_together():
    class KernelConfigLike:  # vLLM's KernelConfig object instead of a dict: read by attribute
        linear_backend = "marlin"
        linear_backend_per_quant = None

    with pytest.raises(EngineArgsConflict) as ei:
        build_engine_kwargs(
            JETRL,
            {
                "quantization": "awq",
                "linear_backend": "cutlass",
                "kernel_config": KernelConfigLike(),
            },
        )
    msg = str(ei.value)
    assert "quantization: you set 'awq'" in msg
    assert "linear_backend: you set 'cutlass'" in msg
    assert "kernel_config.linear_backend: you set 'marlin'" in msg


# -- plugin entry point and vLLM's variables ----------------------------------------------------


def _ep(value: str, name: str = PLUGIN_NAME) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=PLUGIN_GROUP)


def test_the_kernel_settings_reach_vllms_compile_cache_key():
    """vLLM keys its torch.compile cache on ``VllmConfig.compute_hash``, which hashes
    ``additional_config`` but neither ``hf_overrides`` nor our settings variable; our ops take the
    scale mode and eps as constants of the traced graph. So the settings go into
    ``additional_config`` (a user's own entries kept): a pow2 and an FP32-scale engine of one
    model get two cache entries (found by reading vLLM's compile cache, 2026-12-01)."""
    from nemo_jetrl.vllm_patch.engine_args import CACHE_KEY

    pow2 = build_engine_kwargs(JETRL, {"additional_config": {"mine": 1}}).kwargs
    fp32_recipe = Recipe.preset("jetrl").with_(
        train=JETRL.train.with_(pow2_weight_scales=False),
        rollout=JETRL.rollout.with_(pow2_weight_scales=False, pow2_activation_scales=False),
    )
    fp32 = build_engine_kwargs(fp32_recipe).kwargs
    assert pow2["additional_config"]["mine"] == 1
    assert pow2["additional_config"][CACHE_KEY] == settings_from_recipe(JETRL).to_json()
    assert fp32["additional_config"][CACHE_KEY] != pow2["additional_config"][CACHE_KEY]
    assert "additional_config" not in build_engine_kwargs(Recipe.preset("bf16")).kwargs
    with pytest.raises(EngineArgsConflict, match="additional_config: expected a dict, got str"):
        build_engine_kwargs(JETRL, {"additional_config": "x"})


def test_plugin_entry_point_present_and_loadable():
    assert plugin_problems([_ep(PLUGIN_TARGET), _ep("other.mod:f", name="other")]) == []


@pytest.mark.parametrize(
    ("eps", "says"),
    [
        ([], "is not installed here"),
        ([_ep("other.mod:f", name="other")], "is not installed here"),
        ([_ep("nemo_jetrl.vllm_patch.old_plugin:load")], "a stale or foreign install"),
    ],
)
def test_plugin_entry_point_missing_or_foreign(eps, says):
    (problem,) = plugin_problems(eps)
    assert says in problem and PLUGIN_NAME in problem


def test_plugin_entry_point_that_fails_to_import(monkeypatch):
    # vLLM would only log this (load_plugins_by_group catches it) and start without our kernel.
    monkeypatch.setitem(sys.modules, PLUGIN_TARGET.split(":")[0], None)  # import -> error
    (problem,) = plugin_problems([_ep(PLUGIN_TARGET)])
    assert "fails to load (ModuleNotFoundError" in problem


def test_env_variables_as_vllm_parses_them():
    assert env_problems(KERNEL, None, []) == []  # unset VLLM_PLUGINS: every plugin loads
    assert env_problems(KERNEL, ["x", PLUGIN_NAME], ["CutlassFp8BlockScaledMMKernel"]) == []
    (p,) = env_problems(KERNEL, ["other_plugin"], [])
    assert p.startswith("VLLM_PLUGINS='other_plugin' does not list 'nemo_jetrl'")
    (p,) = env_problems(KERNEL, None, ["Foo", KERNEL])
    assert p.startswith(f"VLLM_DISABLED_KERNELS='Foo,{KERNEL}' names {KERNEL}")
    assert len(env_problems(KERNEL, [""], [KERNEL])) == 2  # VLLM_PLUGINS="" allows nothing


def test_guard_errors_are_user_errors():
    # The jetrl CLI prints UserErrors without a traceback, exit code 2.
    assert issubclass(KernelGuardError, UserError) and issubclass(KernelNotInEffect, UserError)


# -- the workers' reports -----------------------------------------------------------------------


def _report(layers: dict, *, registered=True, env=None) -> dict:
    s = settings_from_recipe(JETRL).to_json()
    out = {}
    for name, kernel in layers.items():
        ours = kernel == KERNEL
        out[name] = {"kernel": kernel, "ours": ours, "settings": s if ours else None}
    return {
        "layers": out,
        "registered": registered,
        "env": env if env is not None else {ENV_VAR: s},
    }


LAYERS = [f"model.layers.{i}.{p}" for i in range(2) for p in ("qkv_proj", "o_proj")]


def test_kernel_reports_all_ours_pass():
    s = settings_from_recipe(JETRL)
    assert kernel_problems([_report(dict.fromkeys(LAYERS, KERNEL))] * 2, s, KERNEL) == []


def test_kernel_reports_name_each_layer_on_another_kernel_and_the_cause():
    s = settings_from_recipe(JETRL)
    layers = dict.fromkeys(LAYERS, KERNEL) | {LAYERS[1]: "CutlassFp8BlockScaledMMKernel"}
    env = {"VLLM_PLUGINS": None, "VLLM_DISABLED_KERNELS": KERNEL, ENV_VAR: s.to_json()}
    good = _report(dict.fromkeys(LAYERS, KERNEL))
    (p,) = kernel_problems([good, _report(layers, env=env)], s, KERNEL)
    assert p.startswith("worker 1: 1 of 4 block-FP8 linears run CutlassFp8BlockScaledMMKernel")
    assert LAYERS[1] in p and LAYERS[0] not in p
    assert f"the worker has VLLM_DISABLED_KERNELS='{KERNEL}'" in p


def test_kernel_reports_other_settings_missing_plugin_and_no_fp8_layers():
    s = settings_from_recipe(JETRL)
    other = _report(dict.fromkeys(LAYERS, KERNEL))
    other["layers"][LAYERS[0]]["settings"] = "{}"
    (p,) = kernel_problems([other], s, KERNEL)
    assert f"run {KERNEL} with other settings" in p and LAYERS[0] in p
    unpatched = _report(
        dict.fromkeys(LAYERS, "CPUFp8BlockScaledMMKernel"), registered=False, env={}
    )
    (p,) = kernel_problems([unpatched], s, KERNEL)
    assert "4 of 4" in p and f"{ENV_VAR} is not set in the worker" in p
    assert "plugin not installed or skipped there" in p
    (p,) = kernel_problems([_report({})], s, KERNEL)
    assert "no block-FP8 linear layer at all" in p
    # A recipe keeping whole decoder layers in BF16 may leave a tiny model with none.
    first_last = settings_from_recipe(
        Recipe.preset("jetrl").with_(
            rollout=dataclasses.replace(JETRL.rollout, bf16_first_layers=1, bf16_last_layers=1)
        ),
        num_layers=2,
    )
    assert kernel_problems([_report({})], first_last, KERNEL) == []
    # A BF16 rollout has no block-FP8 linears to check.
    assert kernel_problems([_report({})], settings_from_recipe(Recipe.preset("bf16")), KERNEL) == []


def test_kernel_report_names_are_bounded():
    s = settings_from_recipe(JETRL)
    many = [f"model.layers.{i}.mlp.down_proj" for i in range(30)]
    (p,) = kernel_problems(
        [_report(dict.fromkeys(many, "TritonFp8BlockScaledMMKernel"))], s, KERNEL
    )
    assert "30 of 30" in p and "and 18 more" in p


def test_guard_names_the_entry_point_pyproject_declares():
    from pathlib import Path

    import tomllib

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["entry-points"][PLUGIN_GROUP]
    assert declared[PLUGIN_NAME] == PLUGIN_TARGET
    # The other plugins: the NeMo-RL refit hook (inert unless NEMO_JETRL_NRL_REFIT is set) and
    # the rehearsal's CPU substitutes (inert unless NEMO_JETRL_REHEARSAL is set).
    assert set(declared) - {PLUGIN_NAME} == {"nemo_jetrl_nemo_rl_refit", "nemo_jetrl_rehearsal"}
