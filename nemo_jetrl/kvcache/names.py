"""Where per-layer Q/K/V scales live in vLLM and in Megatron-Core, by decoder layer index.

vLLM (Llama, Qwen2, Qwen3 and other families built the same way): each decoder layer's
``self_attn`` holds an ``Attention`` module named ``attn`` whose ``k_scale``/``v_scale``/``q_scale``
are the dequantization multipliers of the FP8 KV cache (and of FP8 queries). Checkpoints and
NeMo-RL's refit send them as ``model.layers.{i}.self_attn.k_scale`` / ``.v_scale`` (vLLM's
``maybe_remap_kv_scale_name`` inserts the ``.attn`` hop when loading) and
``model.layers.{i}.self_attn.attn.q_scale`` (already spelled with the hop).

Megatron-Core (GPTModel): decoder layer ``i`` of a pipeline stage is ``decoder.layers.{i}``; its
``self_attention.core_attention`` receives Q, K, V after ``linear_qkv``, the optional q/k layernorm
and RoPE, i.e. exactly what a KV cache stores, so that is where observers and on-policy KV hook
in. Megatron has no scale parameters of its own; we name the scales after that module. Wrappers
(DDP, Float16Module) prepend ``module.``; with pipeline parallelism ``i`` is local to the stage,
so pass the stage's first global layer as ``layer_offset``.
"""

from __future__ import annotations

import re

TENSORS: tuple[str, ...] = ("q", "k", "v")

_MEGATRON_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.self_attention(?:\.|$)")
_HF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn(?:\.|$)")


def vllm_scale_name(layer: int, tensor: str) -> str:
    """vLLM / NeMo-RL refit name of the ``tensor`` ("q", "k" or "v") scale of decoder ``layer``."""
    _check(tensor)
    if tensor == "q":
        return f"model.layers.{layer}.self_attn.attn.q_scale"
    return f"model.layers.{layer}.self_attn.{tensor}_scale"


def megatron_core_attention(layer: int, *, layer_offset: int = 0) -> str:
    """The Megatron-Core module whose forward inputs are the post-RoPE Q, K, V of ``layer``.

    ``layer`` is the global decoder index; ``layer_offset`` is the first global layer of this
    pipeline stage (Megatron numbers layers per stage).
    """
    local = layer - layer_offset
    if local < 0:
        raise ValueError(
            f"layer {layer} is before this pipeline stage's first layer {layer_offset}"
        )
    return f"decoder.layers.{local}.self_attention.core_attention"


def megatron_scale_name(layer: int, tensor: str, *, layer_offset: int = 0) -> str:
    """Our name for a scale on the Megatron side: the core-attention module plus ``{t}_scale``."""
    _check(tensor)
    return f"{megatron_core_attention(layer, layer_offset=layer_offset)}.{tensor}_scale"


def layer_index_from_megatron(module_name: str, *, layer_offset: int = 0) -> int | None:
    """Global decoder index of a Megatron attention module name (``module.`` prefixes allowed)."""
    m = _MEGATRON_LAYER.search(module_name)
    return None if m is None else int(m.group(1)) + layer_offset


def layer_index_from_hf(module_name: str) -> int | None:
    """Decoder index of a HuggingFace/vLLM attention module or scale name (``...layers.{i}.self_attn``)."""
    m = _HF_LAYER.search(module_name)
    return None if m is None else int(m.group(1))


def _check(tensor: str) -> None:
    if tensor not in TENSORS:
        raise ValueError(f"tensor must be one of {TENSORS}, got {tensor!r}")
