"""HF checkpoint names -> where their tensors live in a vLLM model (no vLLM import): the model's
``hf_to_vllm_mapper`` prefixes (Qwen3.5's multimodal checkpoint: ``model.language_model.`` ->
``language_model.model.``) and, for a fused layer with more outputs than HF shards, which outputs
one HF tensor fills (Qwen3.5's ``in_proj_qkv`` -> outputs 0-2 of ``in_proj_qkvz``)."""

from __future__ import annotations

import torch


def engine_path(model: torch.nn.Module, hf_name: str) -> str:
    """``hf_name`` (or a module path) as a path in ``model``: a name whose first part is not one
    of the model's children is mapped by the model's ``hf_to_vllm_mapper`` prefixes (Qwen3.5's
    multimodal checkpoint: ``model.language_model.`` -> ``language_model.model.``)."""
    if hf_name.split(".", 1)[0] in dict(model.named_children()):
        return hf_name
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    for old, new in (getattr(mapper, "orig_to_new_prefix", None) or {}).items():
        if old and new is not None and hf_name.startswith(old):
            return new + hf_name[len(old) :]
    return hf_name


def stacked_outputs(model: torch.nn.Module, proj: str, fused: str, i: int, n: int) -> list[int]:
    """The output indices of ``fused`` (``n`` widths) that HF shard ``proj`` (the ``i``-th of
    its packed list of ``n`` shards: ``[i]``) fills. Where the fused layer has more outputs
    than HF shards, the model's stacked mapping says (Qwen3.5: ``in_proj_qkv`` -> outputs 0,
    1, 2 of ``in_proj_qkvz``, ``in_proj_z`` -> 3)."""
    packed = (getattr(model, "packed_modules_mapping", {}) or {}).get(fused, [])
    if n == len(packed):
        return [i]
    for module in model.modules():
        mapper = getattr(type(module), "hf_to_vllm_mapper", None)
        stacked = getattr(mapper, "orig_to_new_stacked", None) or {}
        new, idx = stacked.get(f".{proj}", (None, None))
        idx = idx if isinstance(idx, tuple) else (idx,)
        if new == f".{fused}" and all(isinstance(x, int) for x in idx):
            return list(idx)
    raise KeyError(
        f"{proj}: {fused} has {n} outputs for {len(packed)} HF shards and no stacked "
        "mapping in the model says which this one fills"
    )
