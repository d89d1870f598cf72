"""vllm_patch pieces that need no vLLM, engine side: the engine kwargs merge, the vLLM version
checks, apply_patches and the plugin without vLLM, the version adapters in compat.py, and
the shutdown's accelerator sync.

The trainer side (patch settings from recipes, refit guards) is test_vllm_patch_settings.py."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from nemo_jetrl._optional import MissingDependencyError
from nemo_jetrl.recipe import Recipe
from nemo_jetrl.vllm_patch import (
    EngineArgsConflict,
    UnsupportedVllmVersion,
    apply_patches,
    build_engine_kwargs,
    check_vllm_version,
    supported_range,
)
from nemo_jetrl.vllm_patch.engine_args import ComposedHfOverrides
from nemo_jetrl.vllm_patch.plugin import load_in_worker
from nemo_jetrl.vllm_patch.settings import ENV_VAR

JETRL = Recipe.preset("jetrl")


# -- engine kwargs -----------------------------------------------------------------------------


def test_engine_kwargs_for_jetrl():
    ek = build_engine_kwargs(JETRL)
    kw = ek.kwargs
    assert kw["quantization"] == "fp8"
    qc = kw["hf_overrides"]["quantization_config"]
    assert qc == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"],
    }
    assert kw["load_format"] == "dummy"
    assert kw["worker_extension_cls"].endswith("JetRLWorkerExtension")
    assert kw["compilation_config"]["pass_config"]["fuse_norm_quant"] is False
    assert kw["kv_cache_dtype"] == "auto"
    assert ek.notes == ()


def test_engine_kwargs_kv_fp8_and_bf16_rollout():
    assert build_engine_kwargs(Recipe.preset("jetrl_kv")).kwargs["kv_cache_dtype"] == "fp8"
    kw = build_engine_kwargs(Recipe.preset("bf16")).kwargs
    assert "quantization" not in kw and "hf_overrides" not in kw


def test_engine_kwargs_merge_keeps_every_user_key():
    user = {
        "gpu_memory_utilization": 0.05,
        "hf_overrides": {"max_position_embeddings": 512, "quantization_config": {"note": "x"}},
        "compilation_config": {"mode": 0},
        "seed": 3,
    }
    ek = build_engine_kwargs(JETRL, user)
    kw = ek.kwargs
    assert kw["gpu_memory_utilization"] == 0.05 and kw["seed"] == 3
    assert kw["hf_overrides"]["max_position_embeddings"] == 512
    assert kw["hf_overrides"]["quantization_config"]["note"] == "x"
    assert kw["hf_overrides"]["quantization_config"]["weight_block_size"] == [128, 128]
    assert kw["compilation_config"]["mode"] == 0
    assert kw["compilation_config"]["pass_config"]["fuse_act_quant"] is False
    assert user["hf_overrides"] == {
        "max_position_embeddings": 512,
        "quantization_config": {"note": "x"},
    }, "the user's dict must not be mutated"


def test_engine_kwargs_user_default_overrides_are_kept_and_noted():
    ek = build_engine_kwargs(JETRL, {"load_format": "auto"})
    assert ek.kwargs["load_format"] == "auto"
    assert any("load_format" in n and "'auto'" in n for n in ek.notes)


def test_engine_kwargs_conflicts_all_reported():
    user = {
        "quantization": "awq",
        "hf_overrides": {"quantization_config": {"weight_block_size": [64, 64]}},
        "kv_cache_dtype": "fp8",
    }
    with pytest.raises(EngineArgsConflict) as ei:
        build_engine_kwargs(JETRL, user)
    msg = str(ei.value)
    assert "quantization: you set 'awq'" in msg
    assert "hf_overrides.quantization_config.weight_block_size" in msg and "[64, 64]" in msg
    # kv_cache_dtype is a default for a BF16-KV recipe: user value is kept, not a conflict
    assert "kv_cache_dtype" not in msg
    with pytest.raises(EngineArgsConflict, match="kv_cache_dtype"):
        build_engine_kwargs(Recipe.preset("jetrl_kv"), {"kv_cache_dtype": "auto"})


def test_engine_kwargs_callable_hf_overrides_composed():
    def user_fn(cfg):
        cfg.max_position_embeddings = 99
        return cfg

    ek = build_engine_kwargs(JETRL, {"hf_overrides": user_fn})
    fn = ek.kwargs["hf_overrides"]
    assert isinstance(fn, ComposedHfOverrides)
    cfg = fn(types.SimpleNamespace(quantization_config=None))
    assert cfg.max_position_embeddings == 99
    assert cfg.quantization_config["weight_block_size"] == [128, 128]

    def bad_fn(cfg):
        cfg.quantization_config = {"quant_method": "awq"}
        return cfg

    bad = build_engine_kwargs(JETRL, {"hf_overrides": bad_fn}).kwargs["hf_overrides"]
    with pytest.raises(EngineArgsConflict, match="quant_method"):
        bad(types.SimpleNamespace())


def test_engine_kwargs_bad_hf_overrides_type():
    with pytest.raises(EngineArgsConflict, match="hf_overrides: expected a dict"):
        build_engine_kwargs(JETRL, {"hf_overrides": ["x"]})


# -- version checks and apply without vLLM ------------------------------------------------------


@pytest.mark.parametrize(
    "v",
    [
        "0.32.0",
        "0.32.3",
        "0.32.0+cpu",
        "0.32.1rc1",
        "0.32.0.dev7",
        "0.20.0",
        "0.20.0+cpu",
        "0.25.1",
        "0.33.0",
        "0.33.0+cu130",
    ],
)
def test_version_supported(v):
    check_vllm_version(v)


# Releases not run against a real build (0.20.1/0.20.2, 0.25.0/0.25.2, ...) are refused.
@pytest.mark.parametrize(
    "v",
    ["0.31.9", "0.33.1", "0.34.0", "1.0.0", "0.10.2", "0.19.1", "0.20.1", "0.25.0", "0.25.2"],
)
def test_version_refused_with_range(v):
    with pytest.raises(UnsupportedVllmVersion) as ei:
        check_vllm_version(v)
    assert v in str(ei.value) and supported_range() in str(ei.value)


def test_version_unparseable():
    with pytest.raises(UnsupportedVllmVersion, match="cannot parse"):
        check_vllm_version("main")


def test_apply_without_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(MissingDependencyError, match=r"setup_vllm_env\.sh"):
        apply_patches(JETRL)
    assert ENV_VAR not in os.environ


def test_apply_refuses_unsupported_vllm_and_leaves_no_trace(monkeypatch):
    # A stand-in module object carrying only a version string: the version check must refuse
    # before anything of vLLM is touched.
    fake = types.ModuleType("vllm")
    fake.__version__ = "0.30.1"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(UnsupportedVllmVersion, match=r"0\.30\.1"):
        apply_patches(JETRL)
    assert ENV_VAR not in os.environ


def test_plugin_is_inert_without_env(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert load_in_worker() is None  # must not even import vLLM


def test_plugin_refuses_malformed_env(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "{not json")
    with pytest.raises(ValueError, match=ENV_VAR):
        load_in_worker()


def test_importing_the_package_patches_nothing():
    import importlib

    import nemo_jetrl.vllm_patch as vp

    importlib.reload(vp)
    assert ENV_VAR not in os.environ


# -- version adapters (compat.py) that need no vLLM ----------------------------------------------


def test_supported_ranges_cover_the_tested_releases_only():
    from nemo_jetrl.vllm_patch import compat

    assert supported_range() == ">=0.20.0,<0.20.1 or >=0.25.1,<0.25.2 or >=0.32.0,<0.33.1"
    assert compat.release("0.20.0+cpu") == (0, 20, 0)
    assert compat.release("0.33.0.dev5") == (0, 33, 0)
    assert compat.release("1") == (1, 0, 0)
    with pytest.raises(ValueError, match="cannot parse"):
        compat.release("v0.20")


def test_engine_kwargs_refuse_calculate_kv_scales_with_fp8_kv():
    kv = Recipe.preset("jetrl_kv")
    with pytest.raises(EngineArgsConflict, match="calculate_kv_scales: you set True"):
        build_engine_kwargs(kv, {"calculate_kv_scales": True})
    # With a BF16 KV cache the flag changes nothing of ours: passed through untouched.
    assert build_engine_kwargs(JETRL, {"calculate_kv_scales": True}).kwargs["calculate_kv_scales"]


@pytest.mark.parametrize("line", ["0.20", "0.32"])
def test_set_attention_kv_scales_writes_every_copy_each_vllm_line_keeps(line):
    """The attributes vLLM 0.20 and 0.32 put on an attention layer (read from their
    ``set_default_quant_scales``), on a plain module: every copy gets the scale, and 0.20's
    ``calculate_kv_scales`` is switched off so the first batch cannot overwrite it."""
    from nemo_jetrl.vllm_patch import compat

    layer = torch.nn.Module()
    for k in "qkv":
        layer.register_buffer(f"_{k}_scale", torch.tensor(1.0))
        setattr(layer, f"_{k}_scale_float", 1.0)
        if line == "0.32":
            setattr(layer, f"_{k}_scale_cpu", torch.tensor(1.0))
    if line == "0.20":
        layer.calculate_kv_scales = True
    assert compat.is_attention_layer(layer) and not compat.is_attention_layer(torch.nn.Linear(2, 2))
    compat.set_attention_kv_scales(layer, {"q": 0.5, "k": 0.25, "v": 0.125})
    got = compat.read_attention_kv_scales(layer)
    assert got == {
        "q": 0.5,
        "q_tensor": 0.5,
        "k": 0.25,
        "k_tensor": 0.25,
        "v": 0.125,
        "v_tensor": 0.125,
    }
    if line == "0.32":
        assert [float(getattr(layer, f"_{k}_scale_cpu")) for k in "qkv"] == [0.5, 0.25, 0.125]
    else:
        assert layer.calculate_kv_scales is False


def test_shutdown_syncs_no_accelerator_only_while_there_is_none(monkeypatch):
    """`shutdown._no_accelerator_sync`: without an accelerator, vLLM 0.20's
    ``torch.accelerator.synchronize()`` at an in-process worker's shutdown raised (CUDA build of
    torch, no driver; a CPU build raises too): a no-op for the shutdown's length, then torch's
    own again. With one, nothing is replaced (both answers set here, whatever this machine has)."""
    from nemo_jetrl.vllm_patch.shutdown import _no_accelerator_sync

    def own(device=None):  # torch's answer on a machine without one
        raise RuntimeError("Cannot access accelerator device when none is available.")

    monkeypatch.setattr(torch.accelerator, "synchronize", own)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    with _no_accelerator_sync() as replaced:
        assert replaced and torch.accelerator.synchronize is not own
        torch.accelerator.synchronize()  # what vLLM 0.20's model runner calls first
    assert torch.accelerator.synchronize is own
    with pytest.raises(KeyError), _no_accelerator_sync():
        raise KeyError("the shutdown failed")  # still put back
    assert torch.accelerator.synchronize is own
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    with _no_accelerator_sync() as replaced:
        assert not replaced and torch.accelerator.synchronize is own
