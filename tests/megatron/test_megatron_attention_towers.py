"""Which core attentions our Megatron KV hooks take: the language decoder's only.

Found by reading Megatron-Core and Megatron-Bridge (2026-12-01): with multi-token prediction on
(NeMo-RL passes ``mtp_num_layers``), Megatron-Core 0.16 has
``mtp.layers.N.transformer_layer.self_attention.core_attention`` (later versions
``mtp.layers.N.mtp_model_layer...``), and the worker's start failed reading a decoder layer index
from it; Megatron-Bridge's Qwen3-VL / Qwen3.5 model has ``vision_model.decoder.layers.N`` beside
``language_model.decoder.layers.N``, so a vision layer's amax went into language layer N's scale
and on-policy KV fake-quantized the vision tower's Q/K/V, which vLLM never does.

Stand-in module trees carry those names (the tensors' math is test_megatron_attention.py's, on a
real GPTModel): only the language decoder's layers are found and hooked; two modules for one
layer index are refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nemo_jetrl.kvcache import KVScales
from nemo_jetrl.megatron.attention import attach_megatron_kv, core_attention_modules


class _Core(nn.Module):
    def forward(self, q, k, v, mask=None):  # type: ignore[no-untyped-def]
        return k


def _layers(n: int, inner: str | None = None) -> nn.Module:
    """``layers.i.[inner.]self_attention.core_attention`` for i < n."""
    layers = nn.ModuleList()
    for _ in range(n):
        attn = nn.Module()
        attn.core_attention = _Core()
        layer = nn.Module()
        layer.self_attention = attn
        if inner:
            outer = nn.Module()
            setattr(outer, inner, layer)
            layer = outer
        layers.append(layer)
    holder = nn.Module()
    holder.layers = layers
    return holder


def _vlm_with_mtp() -> nn.Module:
    model = nn.Module()
    model.language_model = nn.Module()
    model.language_model.decoder = _layers(2)
    model.language_model.mtp = _layers(1, "transformer_layer")  # Megatron-Core 0.16
    model.vision_model = nn.Module()
    model.vision_model.decoder = _layers(3)
    model.mtp = _layers(1, "mtp_model_layer")  # later Megatron-Core
    wrapper = nn.Module()  # Float16Module / DDP prepend "module."
    wrapper.module = model
    return wrapper


def test_only_the_language_decoders_attentions_are_found_and_hooked():
    model = _vlm_with_mtp()
    found = core_attention_modules(model)
    assert [(layer, name) for layer, name, _ in found] == [
        (0, "module.language_model.decoder.layers.0.self_attention.core_attention"),
        (1, "module.language_model.decoder.layers.1.self_attention.core_attention"),
    ]
    assert [layer for layer, _, _ in core_attention_modules(model, layer_offset=4)] == [4, 5]
    handle = attach_megatron_kv(model, onpolicy=True)
    try:
        handle.set_scales(
            KVScales(layers={0: {"k": 2.0**-6, "v": 2.0**-6}, 1: {"k": 1.0, "v": 1.0}})
        )
        x = torch.full((2, 1, 1, 4), 0.3)  # not an FP8 value at scale 2**-6
        lang = model.module.language_model.decoder.layers[0].self_attention.core_attention
        vision = model.module.vision_model.decoder.layers[0].self_attention.core_attention
        mtp = model.module.mtp.layers[0].mtp_model_layer.self_attention.core_attention
        assert not torch.equal(lang(x, x, x), x)  # hooked: fake-quantized keys
        assert torch.equal(vision(x, x, x), x) and torch.equal(mtp(x, x, x), x)
        assert handle.layers == [0, 1]
    finally:
        handle.restore()


def test_two_attentions_for_one_layer_index_are_refused():
    model = nn.Module()
    model.decoder = _layers(2)
    model.extra = nn.Module()
    model.extra.decoder = _layers(1)  # another tower this code does not know
    with pytest.raises(ValueError, match=r"decoder layer 0 has two core attentions"):
        core_attention_modules(model)
