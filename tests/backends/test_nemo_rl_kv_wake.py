"""The refit's FP8 KV scales through vLLM's KV-cache wake-up (`backends/nemo_rl/kv_wake.py`).

vLLM 0.20/0.25/0.32's ``GPUModelRunner.init_fp8_kv_scales`` (called when a sleeping engine's KV
cache wakes, which NeMo-RL does after every refit) zeroes the cache and sets ``_k_scale``,
``k_scale``, ``_v_scale`` and ``v_scale`` of every attention layer to 1.0, leaving the host floats
(read in vLLM's source, 2026-12-01). vLLM's CPU platform has no sleep mode, so a stand-in runner
does exactly that here (labelled); the hook's install on vLLM's real class is
test_nemo_rl_refit_hook.py's. The attention layer is shaped like vLLM's (``_x_scale`` device
tensors, ``_x_scale_float`` host floats, ``k_scale``/``v_scale`` loaded parameters).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nemo_jetrl.backends.nemo_rl import kv_wake
from nemo_jetrl.vllm_patch import compat


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for t in ("q", "k", "v"):
            self.register_buffer(f"_{t}_scale", torch.tensor(1.0))
            setattr(self, f"_{t}_scale_float", 1.0)
        self.k_scale = nn.Parameter(torch.tensor(1.0), requires_grad=False)
        self.v_scale = nn.Parameter(torch.tensor(1.0), requires_grad=False)


class _Runner:
    """Stand-in for vLLM's GPU model runner: its ``init_fp8_kv_scales`` as vLLM writes it."""

    def __init__(self) -> None:
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module() for _ in range(2)])
        for layer in self.model.layers:
            layer.attn = _Attention()
        self.kv_caches = [torch.ones(4), torch.ones(4)]

    def init_fp8_kv_scales(self) -> None:
        for cache in self.kv_caches:
            cache.zero_()
        for layer in self.model.layers:
            for name in ("_k_scale", "k_scale", "_v_scale", "v_scale"):
                getattr(layer.attn, name).data.fill_(1.0)


def _f32(v: float) -> float:  # a refit's scales are fp32 values (NeMo-RL sends [1] fp32 tensors)
    return float(torch.tensor(v, dtype=torch.float32))


SCALES = {f"layers.{i}.attn": {"k": _f32(0.01 + i), "v": _f32(0.02 + i)} for i in range(2)}


def test_the_kept_scales_are_back_after_vllms_wake_up_reset(monkeypatch):
    runner = _Runner()
    for layer, per in SCALES.items():  # what the refit loaded
        attn = runner.model.get_submodule(layer)
        compat.set_attention_kv_scales(attn, {"q": 1.0, **per})
        attn.k_scale.data.fill_(per["k"])
        attn.v_scale.data.fill_(per["v"])
    kv_wake.keep_kv_scales(runner, SCALES)
    plain = _Runner.init_fp8_kv_scales
    plain(runner)  # vLLM alone: the device tensors back at 1.0, the host floats not
    attn0 = runner.model.get_submodule("layers.0.attn")
    assert float(attn0._k_scale) == 1.0 and attn0._k_scale_float == _f32(0.01)
    monkeypatch.setattr(_Runner, "init_fp8_kv_scales", kv_wake.wake_wrapper(plain))
    runner.init_fp8_kv_scales()
    assert all(float(c.sum()) == 0 for c in runner.kv_caches)  # vLLM's part still ran
    for layer, per in SCALES.items():
        attn = runner.model.get_submodule(layer)
        used = compat.read_attention_kv_scales(attn)
        for t, v in per.items():
            assert used[t] == used[f"{t}_tensor"] == float(getattr(attn, f"{t}_scale")) == v
        assert used["q"] == 1.0  # a scale the refit did not send keeps what it had


def test_later_refits_update_the_kept_scales_and_nothing_kept_leaves_vllms_default():
    runner = _Runner()
    assert kv_wake.restore_kv_scales(runner) == 0  # no refit yet: vLLM's 1.0 stays
    kv_wake.keep_kv_scales(runner, SCALES)
    kv_wake.keep_kv_scales(runner, {"layers.1.attn": {"k": 0.5}})
    assert getattr(runner, kv_wake.KEPT)["layers.1.attn"] == {"k": 0.5, "v": _f32(1.02)}
    assert kv_wake.restore_kv_scales(runner) == 4


def test_a_scale_that_does_not_read_back_is_an_error(monkeypatch):
    runner = _Runner()
    kv_wake.keep_kv_scales(runner, SCALES)
    monkeypatch.setattr(compat, "set_attention_kv_scales", lambda module, scales: None)
    with pytest.raises(RuntimeError, match=r"layers\.0\.attn: the refit's KV scales \['k', 'v'\]"):
        kv_wake.restore_kv_scales(runner)
