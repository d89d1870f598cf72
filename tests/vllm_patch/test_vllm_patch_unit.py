"""vllm_patch pieces that need no vLLM: settings, engine-kwargs merge, guards, version checks."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import types

import pytest
import torch

from nemo_jetrl._optional import MissingDependencyError
from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise
from nemo_jetrl.recipe import Recipe
from nemo_jetrl.vllm_patch import (
    EngineArgsConflict,
    PatchSettings,
    UnsupportedVllmVersion,
    apply_patches,
    build_engine_kwargs,
    check_vllm_version,
    settings_from_recipe,
    supported_range,
)
from nemo_jetrl.vllm_patch.engine_args import ComposedHfOverrides
from nemo_jetrl.vllm_patch.plugin import load_in_worker
from nemo_jetrl.vllm_patch.refit import (
    RefitError,
    is_fp8_weight,
    normalize_kv_scales,
    quantize_state_dict,
    refit,
)
from nemo_jetrl.vllm_patch.settings import ENV_VAR
from nemo_jetrl.vllm_patch.worker_ext import pack, unpack

JETRL = Recipe.preset("jetrl")


def _with_rollout(recipe: Recipe, **changes) -> Recipe:
    return recipe.with_(rollout=dataclasses.replace(recipe.rollout, **changes))


# -- settings from recipes ---------------------------------------------------------------------


def test_settings_from_presets():
    s = settings_from_recipe(JETRL)
    assert s.fp8_weights and s.pow2_weight_scales and s.pow2_activation_scales
    assert s.modules_to_not_convert == ("lm_head",)
    assert s.kv_cache_dtype == "auto"
    assert settings_from_recipe(Recipe.preset("jetrl_kv")).kv_cache_dtype == "fp8"
    assert settings_from_recipe(Recipe.preset("bf16")).fp8_weights is False


def test_settings_refuse_vllm_quantizer_with_reason():
    with pytest.raises(ValueError, match=r"rollout.quantizer='vllm'"):
        settings_from_recipe(Recipe.preset("fp8_rollout"))


def test_settings_bf16_layers_named_for_vllm():
    r = _with_rollout(JETRL, bf16_first_layers=1, bf16_last_layers=1)
    with pytest.raises(ValueError, match="num_layers"):
        settings_from_recipe(r)
    s = settings_from_recipe(r, num_layers=4)
    names = set(s.modules_to_not_convert)
    for i in (0, 3):
        assert f"model.layers.{i}.self_attn.q_proj" in names
        assert f"model.layers.{i}.mlp.down_proj" in names
    assert not any(".layers.1." in n or ".layers.2." in n for n in names)


def test_settings_mixed_scale_modes_and_json_roundtrip():
    r = _with_rollout(JETRL, pow2_weight_scales=False)
    s = settings_from_recipe(r)
    assert (s.pow2_weight_scales, s.pow2_activation_scales) == (False, True)
    assert PatchSettings.from_json(s.to_json()) == s


def test_settings_invalid_values_reported_together():
    with pytest.raises(ValueError) as ei:
        PatchSettings(fmt="e5m2", kv_cache_dtype="int8", eps=-1.0)
    msg = str(ei.value)
    assert "fmt: got 'e5m2'" in msg and "kv_cache_dtype: got 'int8'" in msg
    assert "eps: got -1.0; expected a finite number >= 0" in msg


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("pow2_weight_scales", "false", "pow2_weight_scales: got 'false'; expected true or false"),
        ("fp8_weights", 1, "fp8_weights: got 1; expected true or false"),
        ("eps", "0", "eps: got '0'; expected a finite number"),
        ("modules_to_not_convert", "lm_head", "modules_to_not_convert: got 'lm_head'"),
        ("nope", True, "nope: unknown key"),
    ],
)
def test_settings_from_json_is_strict(key, value, needle):
    """Issue 26: '{"pow2_weight_scales": "false"}' was accepted and read as true."""
    with pytest.raises(ValueError, match="invalid NEMO_JETRL_VLLM_PATCH") as ei:
        PatchSettings.from_json(json.dumps({key: value}))
    assert needle in str(ei.value)


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


# -- refit guards (trainer side) ---------------------------------------------------------------


def _state_dict(seed=0, hidden=256, inter=512, kv=128):
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(128, hidden, generator=g)}
    for p, shape in (
        ("self_attn.q_proj", (hidden, hidden)),
        ("self_attn.k_proj", (kv, hidden)),
        ("self_attn.v_proj", (kv, hidden)),
        ("self_attn.o_proj", (hidden, hidden)),
        ("mlp.gate_proj", (inter, hidden)),
        ("mlp.up_proj", (inter, hidden)),
        ("mlp.down_proj", (hidden, inter)),
    ):
        sd[f"model.layers.0.{p}.weight"] = torch.randn(*shape, generator=g) * 0.02
    sd["model.layers.0.input_layernorm.weight"] = torch.ones(hidden)
    sd["lm_head.weight"] = torch.randn(128, hidden, generator=g)
    return sd


@pytest.mark.parametrize("pow2", [True, False])
def test_quantize_state_dict_matches_fp8_core(pow2):
    r = _with_rollout(JETRL, pow2_weight_scales=pow2, pow2_activation_scales=pow2)
    sd = _state_dict()
    qsd = quantize_state_dict(sd, r)
    assert len(qsd.fp8_layers) == 7
    for module in qsd.fp8_layers:
        ref = quantize_blockwise(sd[f"{module}.weight"], (128, 128), pow2_scales=pow2)
        assert torch.equal(fp8_bits(qsd.tensors[f"{module}.weight"]), fp8_bits(ref.data))
        assert torch.equal(qsd.tensors[f"{module}.weight_scale_inv"], ref.scale_inv)
    assert qsd.tensors["lm_head.weight"].dtype == torch.bfloat16
    assert "lm_head.weight_scale_inv" not in qsd.tensors
    assert set(qsd.other_names) == {
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "lm_head.weight",
    }


def test_quantize_state_dict_bf16_layers_not_quantized():
    r = _with_rollout(JETRL, bf16_first_layers=1)
    qsd = quantize_state_dict(_state_dict(), settings_from_recipe(r, num_layers=2))
    assert qsd.fp8_layers == ()
    assert qsd.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert not is_fp8_weight(
        "model.layers.0.mlp.up_proj.weight", settings_from_recipe(r, num_layers=2)
    )


def test_quantize_state_dict_guards_report_every_bad_tensor():
    sd = _state_dict()
    sd["model.layers.0.self_attn.o_proj.weight"][3, 5] = float("nan")
    sd["model.layers.0.input_layernorm.weight"][0] = float("inf")
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(500, 256)
    with pytest.raises(RefitError) as ei:
        quantize_state_dict(sd, JETRL)
    msg = str(ei.value)
    assert "model.layers.0.self_attn.o_proj.weight" in msg and "non-finite" in msg
    assert "model.layers.0.input_layernorm.weight" in msg
    assert "model.layers.0.mlp.up_proj.weight" in msg and "(500, 256)" in msg
    assert "nothing was loaded" in msg


def test_kv_scales_normalized_and_validated():
    out = normalize_kv_scales({0: {"q": 0.5, "k": 0.25, "v": torch.tensor(2.0)}})
    assert out == {"model.layers.0.self_attn.attn": {"q": 0.5, "k": 0.25, "v": 2.0}}
    with pytest.raises(RefitError) as ei:
        normalize_kv_scales({0: {"q": 1.0, "k": -1.0, "v": math.nan}, 1: {"q": 1.0, "k": 1.0}})
    msg = str(ei.value)
    assert "layers.0.self_attn.attn.k_scale=-1.0" in msg
    assert "layers.0.self_attn.attn.v_scale=nan" in msg
    assert "layers.1.self_attn.attn.v_scale=None" in msg
    assert "previous scales kept" in msg


class _RecordingEngine:
    """Records collective_rpc calls; used only to assert that a refused refit sends nothing."""

    def __init__(self):
        self.calls = []

    def collective_rpc(self, method, *a, **k):
        self.calls.append(method)
        raise AssertionError(f"nothing should reach the engine, got {method}")


def test_refit_refuses_kv_scales_for_bf16_kv_cache_before_sending():
    eng = _RecordingEngine()
    with pytest.raises(RefitError, match="kv_cache_dtype is 'auto'"):
        refit(eng, _state_dict(), JETRL, kv_scales={0: {"q": 1.0, "k": 1.0, "v": 1.0}})
    assert eng.calls == []


def test_refit_refuses_bad_weights_before_sending():
    eng = _RecordingEngine()
    sd = _state_dict()
    sd["model.layers.0.mlp.down_proj.weight"][0, 0] = float("inf")
    with pytest.raises(RefitError, match="down_proj"):
        refit(eng, sd, JETRL)
    assert eng.calls == []


def test_pack_roundtrip_keeps_fp8_bits():
    q = quantize_blockwise(torch.randn(128, 256), (128, 128))
    back = unpack(pack({"w": q.data, "s": q.scale_inv}))
    assert back["w"].dtype == torch.float8_e4m3fn
    assert torch.equal(fp8_bits(back["w"]), fp8_bits(q.data))
    assert torch.equal(back["s"], q.scale_inv)


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
