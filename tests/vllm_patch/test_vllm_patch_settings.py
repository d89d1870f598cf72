"""vllm_patch pieces that need no vLLM, trainer side: patch settings from recipes (BF16 layers,
scale modes, strict JSON) and the refit guards (quantize_state_dict against the FP8 core,
bad tensors and KV scales refused before anything is sent, packing FP8 bits).

The engine side (engine kwargs, version checks, plugin, compat, shutdown) is
test_vllm_patch_engine_setup.py."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise
from nemo_jetrl.recipe import Recipe
from nemo_jetrl.vllm_patch import PatchSettings, settings_from_recipe
from nemo_jetrl.vllm_patch.refit import (
    RefitError,
    is_fp8_weight,
    normalize_kv_scales,
    quantize_state_dict,
    refit,
)
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
