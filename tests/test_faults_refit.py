"""Fault injection, refit side (issue 17, item 4): every refit path stages and checks everything
before it stores anything, so a refused refit leaves the rollout bit-identical. Each case takes
a snapshot of the state, attempts a bad refit, expects the refusal naming the tensor, and
compares the state bit for bit. Paths here: `Fp8InferenceLinear.load_weight`/`load_quantized`,
the local backend's `refit`, `KVScales` and `KVCacheController.set_scales`. The vLLM path runs
on the real CPU engine in tests/vllm_patch/test_vllm_engine.py
(``test_refused_refits_leave_the_engine_bit_identical``).
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_jetrl.fp8 import Fp8InferenceLinear, Fp8LinearConfig

BF16_MAX = torch.finfo(torch.bfloat16).max


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as raw bytes (bit-exact comparison, NaN-safe)."""
    return {
        k: v.detach().clone().contiguous().view(torch.uint8) for k, v in module.state_dict().items()
    }


def _assert_unchanged(module: torch.nn.Module, before: dict[str, torch.Tensor], label: str):
    after = _snapshot(module)
    assert after.keys() == before.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"{label}: a refused load changed {changed}"


@pytest.fixture
def layer() -> Fp8InferenceLinear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128, bias=True).to(torch.bfloat16)
    return Fp8InferenceLinear.from_linear(lin, Fp8LinearConfig(pow2_scales=True), name="l0")


def test_load_weight_checks_the_bias_before_storing_the_weight(layer):
    before = _snapshot(layer)
    new_w = torch.randn(128, 256, dtype=torch.bfloat16)
    for bias, match in (
        (torch.full((128,), math.nan, dtype=torch.bfloat16), "l0.bias: non-finite"),
        (torch.zeros(64, dtype=torch.bfloat16), r"l0.bias: .*\(64,\)"),
        (torch.full((128,), 1e39, dtype=torch.float64), "l0.bias: non-finite"),  # inf in bf16
    ):
        with pytest.raises(ValueError, match=match):
            layer.load_weight(new_w, bias)
        _assert_unchanged(layer, before, match)
    layer.load_weight(new_w, torch.zeros(128, dtype=torch.bfloat16))  # the same call, good bias
    assert not torch.equal(_snapshot(layer)["weight_fp8"], before["weight_fp8"])


def test_weight_that_dequantizes_to_inf_is_refused(layer):
    """BF16-max with power-of-two scales: the scale rounds up to 2**120 and 448 x 2**120
    overflows fp32 (and BF16): the forward would be inf."""
    before = _snapshot(layer)
    w = torch.randn(128, 256, dtype=torch.bfloat16)
    w[5, 200] = BF16_MAX
    with pytest.raises(ValueError, match=r"l0.weight: 1 block\(s\) dequantize past"):
        layer.load_weight(w)
    _assert_unchanged(layer, before, "bf16 max")


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_load_quantized_refuses_nan_fp8_bytes(layer, byte):
    before = _snapshot(layer)
    data = layer.weight_fp8.clone().view(torch.uint8)
    data[3, 7] = byte
    with pytest.raises(ValueError, match=f"encode NaN/inf \\(first {byte:#04x} at \\[3, 7\\]\\)"):
        layer.load_quantized(data, layer.weight_scale_inv.clone())
    _assert_unchanged(layer, before, hex(byte))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_load_quantized_refuses_bad_scales(layer, bad):
    before = _snapshot(layer)
    s = layer.weight_scale_inv.clone()
    s[0, 1] = bad
    with pytest.raises(ValueError, match="scale_inv has 1 non-finite or non-positive"):
        layer.load_quantized(layer.weight_fp8.clone(), s)
    _assert_unchanged(layer, before, str(bad))


def test_bias_for_a_layer_without_bias_is_refused_before_anything_is_stored():
    lin = torch.nn.Linear(128, 128, bias=False).to(torch.bfloat16)
    layer = Fp8InferenceLinear.from_linear(lin, Fp8LinearConfig(), name="nobias")
    before = _snapshot(layer)
    with pytest.raises(ValueError, match="built without bias"):
        layer.load_weight(torch.randn(128, 128), torch.zeros(128))
    _assert_unchanged(layer, before, "bias given")


# ------------------------------------------------------------------------ local backend refit


@pytest.fixture(scope="module")
def rollout_pair():
    """(trainer model, rollout model under the jetrl recipe): the local backend's tiny Llama
    with q/k/v biases so that bias checks are exercised too."""
    from nemo_jetrl.backends.local.model import build_model, load_model_config
    from nemo_jetrl.backends.local.precision import freeze, make_rollout_model
    from nemo_jetrl.recipe import Recipe

    cfg = load_model_config(None)
    cfg.attention_bias = True
    trainer = build_model(cfg, dtype=torch.bfloat16, seed=1)
    rollout = build_model(cfg, dtype=torch.bfloat16, seed=1)
    plan = make_rollout_model(rollout, Recipe.preset("jetrl"))
    assert plan.fp8 is not None and len(plan.fp8.converted) == 14
    return trainer, freeze(rollout)


def _bad_weights(trainer) -> dict[str, dict[str, torch.Tensor]]:
    """Whole state dicts (every other tensor new and valid) with one fault each."""
    from nemo_jetrl.backends.local.refit import export_weights

    def with_(name, fn):
        w = {k: (v.float() * 1.5).to(v.dtype) for k, v in export_weights(trainer).items()}
        w[name] = fn(w[name].clone())
        return w

    def put(value, at=(0, 0)):
        def fn(t):
            t[at] = value
            return t

        return fn

    q = "model.layers.1.self_attn.q_proj"
    return {
        "bf16-max weight, pow2 scales": with_(f"{q}.weight", put(BF16_MAX)),
        "NaN weight": with_("model.layers.0.mlp.up_proj.weight", put(math.nan)),
        "NaN bias": with_(f"{q}.bias", put(math.nan, (3,))),
        "mis-shaped bias": with_(f"{q}.bias", lambda t: t[:64]),
        "norm overflows bf16": with_(
            "model.norm.weight", lambda t: t.float().index_fill(0, torch.tensor([2]), 3.4e38)
        ),
        "missing tensor": {
            k: v for k, v in with_(f"{q}.weight", lambda t: t).items() if k != "lm_head.weight"
        },
    }


def test_local_refit_refusals_leave_the_rollout_bit_identical(rollout_pair):
    from nemo_jetrl.backends.local.refit import RefitRefused, refit

    trainer, rollout = rollout_pair
    before = _snapshot(rollout)
    expected = {
        "bf16-max weight, pow2 scales": "q_proj.weight: 1 block(s) dequantize past",
        "NaN weight": "up_proj.weight",
        "NaN bias": "q_proj.bias: 1 non-finite value(s)",
        "mis-shaped bias": "q_proj.bias: shape (64,)",
        "norm overflows bf16": "model.norm.weight: finite values overflow",
        "missing tensor": "lm_head.weight: missing",
    }
    for label, weights in _bad_weights(trainer).items():
        with pytest.raises(RefitRefused) as ei:
            refit(rollout, weights)
        assert expected[label] in str(ei.value), (label, str(ei.value))
        _assert_unchanged(rollout, before, label)
    # Not vacuous: the same weights without the fault load and change the rollout.
    refit(rollout, {k: (v.float() * 1.5).to(v.dtype) for k, v in trainer.state_dict().items()})
    assert any(not torch.equal(before[k], v) for k, v in _snapshot(rollout).items())


# ------------------------------------------------------------------------------- KV scales


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (True, "got bool"),
        ("0.5", "got str"),
        (1e-46, "it is 0.0 there"),
        (1e39, "it is inf there"),
        (-0.5, "must be finite and > 0"),
        (math.nan, "must be finite and > 0"),
    ],
)
def test_kv_scale_values_follow_one_rule(value, match):
    from nemo_jetrl.kvcache.scales import KVScales
    from nemo_jetrl.vllm_patch.refit import RefitError, normalize_kv_scales

    with pytest.raises(ValueError, match=match):
        KVScales({0: {"k": value, "v": 1.0}})
    with pytest.raises(RefitError, match=match):
        normalize_kv_scales({0: {"q": 1.0, "k": value, "v": 1.0}})


def test_kv_scale_layers_must_exist():
    from nemo_jetrl.kvcache.scales import KVScales
    from nemo_jetrl.vllm_patch.refit import RefitError, normalize_kv_scales

    with pytest.raises(ValueError, match="layer key -1 must be a decoder index >= 0"):
        KVScales({-1: {"k": 1.0}})
    with pytest.raises(RefitError, match="layer key -1 must be a decoder index >= 0"):
        normalize_kv_scales({-1: {"q": 1.0, "k": 1.0, "v": 1.0}})
    assert KVScales({0: {"k": 0.5}}, calibrated_for=7).to_dict()["calibrated_for"] == 7
    assert KVScales.from_dict(KVScales({0: {"k": 0.5}}, calibrated_for=7).to_dict()) == KVScales(
        {0: {"k": 0.5}}, calibrated_for=7
    )


def test_kv_controller_refuses_scales_for_layers_the_model_lacks(rollout_pair):
    from nemo_jetrl.kvcache import CalibrationSettings
    from nemo_jetrl.kvcache.hf import KVCacheController
    from nemo_jetrl.kvcache.scales import KVScales

    _, rollout = rollout_pair
    good = KVScales({0: {"k": 0.5, "v": 0.25}, 1: {"k": 0.125, "v": 2.0}})
    ctl = KVCacheController(CalibrationSettings(), scales=good)
    ctl.attach(rollout, role="rollout")
    try:
        state = ctl.handles["rollout"].state
        with pytest.raises(ValueError, match=r"layers \[2\] do not exist in the rollout model"):
            ctl.set_scales(KVScales({0: {"k": 1.0, "v": 1.0}, 2: {"k": 1.0, "v": 1.0}}))
        assert ctl.scales is good and state.scales is good
    finally:
        ctl.detach()
