"""Dense tensors split over vLLM tensor-parallel ranks: which part of a full HF tensor a rank holds.

What vLLM's loaders write on rank ``r`` of ``tp`` (read in 0.20.0, 0.25.1 and 0.32.0
``linear.py`` / ``vocab_parallel_embedding.py``; engine-checked in
tests/vllm_patch/test_vllm_dense_shards.py):

* column-parallel (``ColumnParallelLinear``; the fused ``MergedColumnParallelLinear`` gate/up and
  ``QKVParallelLinear`` q/k/v, one HF projection per shard): output rows ``r * n .. (r+1) * n``,
  ``n`` the projection's per-rank width (``output_partition_sizes``). k/v with fewer KV heads
  than ranks are replicated: rank ``r`` holds head group ``r // num_kv_head_replicas``.
* row-parallel (``RowParallelLinear``: o_proj, down_proj): input columns ``r * k ..``,
  ``k = input_size_per_partition``; its bias is whole on every rank.
* vocab-parallel embedding / lm_head: rows ``org_vocab_start_index .. org_vocab_end_index`` of
  the checkpoint; the parameter holds them first, then padding.
* block-FP8 ``weight_scale_inv`` [N/128, K/128]: the same slice in 128-blocks (vLLM's block-FP8
  loader narrows the scale by block); a slice not on block edges is refused, naming the tensor.
* anything else (norms, replicated linears, scalars): whole on every rank.

The engine side reads its own parameter (``worker_ext.resolve_hf_name``: the fused shard's rows
on this rank); this module narrows what the trainer sent to the same part.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_jetrl.fp8.spec import WEIGHT_BLOCK

SCALE = "weight_scale_inv"


def _layer(model: Any, hf_name: str) -> tuple[Any, str, str, list[str]] | None:
    """(vLLM layer, HF projection, leaf, the fused layer's HF shards or []) holding HF tensor
    ``hf_name``; None if no such module."""
    from nemo_jetrl.vllm_patch.engine_names import engine_path

    module_path, _, leaf = engine_path(model, hf_name).rpartition(".")
    parent, _, proj = module_path.rpartition(".")
    for fused, shards in (getattr(model, "packed_modules_mapping", {}) or {}).items():
        if proj in shards:
            try:
                return model.get_submodule(f"{parent}.{fused}"), proj, leaf, list(shards)
            except AttributeError:
                continue
    try:
        return model.get_submodule(module_path), proj, leaf, []
    except AttributeError:
        return None


def _kinds() -> dict[str, type]:
    from vllm.model_executor.layers import linear, vocab_parallel_embedding

    return {
        "qkv": linear.QKVParallelLinear,
        "column": linear.ColumnParallelLinear,  # MergedColumnParallelLinear included
        "row": linear.RowParallelLinear,
        "vocab": vocab_parallel_embedding.VocabParallelEmbedding,  # ParallelLMHead included
    }


def dense_slice(model: Any, hf_name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(dim, start, length) of the full HF tensor of ``shape`` named ``hf_name`` that this rank
    holds (see the module docstring); None: the whole tensor (unsplit, or not a TP layer)."""
    found = _layer(model, hf_name)
    if found is None or not shape:
        return None
    layer, proj, leaf, shards = found
    tp, rank = int(getattr(layer, "tp_size", 1)), int(getattr(layer, "tp_rank", 0))
    if tp == 1 or leaf not in ("weight", "bias", SCALE):
        return None
    kinds = _kinds()
    if isinstance(layer, kinds["vocab"]):
        idx = layer.shard_indices
        dim, start = 0, int(idx.org_vocab_start_index)
        length = int(idx.org_vocab_end_index) - start
    elif isinstance(layer, kinds["row"]):
        if leaf == "bias":
            return None
        per = int(layer.input_size_per_partition)
        dim, start, length = 1, rank * per, per
    elif isinstance(layer, kinds["column"]):
        widths = [int(w) for w in layer.output_partition_sizes]
        i = shards.index(proj) if shards else 0
        length = widths[i] if shards else int(layer.output_size_per_partition)
        group = rank
        if isinstance(layer, kinds["qkv"]) and i > 0:  # k/v: replicated when kv heads < tp
            group = rank // int(getattr(layer, "num_kv_head_replicas", 1))
        dim, start = 0, group * length
    else:
        return None  # ReplicatedLinear, norms, ...
    if start + length > shape[dim] * (WEIGHT_BLOCK[dim] if leaf == SCALE else 1):
        raise ValueError(
            f"{hf_name}: shape {shape} has no rows [{start}, {start + length}) in dim {dim} "
            f"for tensor-parallel rank {rank} of {tp} (vLLM's layer: {type(layer).__name__})"
        )
    if leaf == SCALE:
        block = WEIGHT_BLOCK[dim]
        if start % block or length % block:
            raise ValueError(
                f"{hf_name}: tensor-parallel rank {rank} of {tp} holds [{start}, "
                f"{start + length}) of dim {dim}, not on {block}-blocks: its 128x128 FP8 "
                "blocks would not be training's"
            )
        return dim, start // block, length // block
    return dim, start, length


def rank_expected(model: Any, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full dense HF tensor ``tensor`` (a view; the tensor itself when
    the rank holds it whole)."""
    part = dense_slice(model, hf_name, tuple(tensor.shape))
    if part is None:
        return tensor
    dim, start, length = part
    return tensor.narrow(dim, start, length)


def engine_rows(layer: Any, leaf: str, rows: int) -> int:
    """Rows of the parameter ``leaf`` of ``layer`` that hold checkpoint data on this rank: a
    vocab-parallel layer's ``org_vocab`` shard (the rest is padding), else ``rows``."""
    idx = getattr(layer, "shard_indices", None)
    if leaf == "weight" and idx is not None:
        return int(idx.org_vocab_end_index) - int(idx.org_vocab_start_index)
    return rows
