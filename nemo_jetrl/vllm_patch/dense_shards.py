"""Dense tensors split over vLLM tensor-parallel ranks: which part of a full HF tensor a rank holds.

What vLLM's loaders write on rank ``r`` of ``tp`` (read in 0.20.0, 0.25.1 and 0.32.0
``linear.py`` / ``vocab_parallel_embedding.py``; engine-checked in
tests/vllm_patch/test_vllm_dense_shards.py):

* column-parallel (``ColumnParallelLinear``; the fused ``MergedColumnParallelLinear`` gate/up and
  ``QKVParallelLinear`` q/k/v, one HF projection per shard): output rows ``r * n .. (r+1) * n``,
  ``n`` the projection's per-rank width (``output_partition_sizes``). k/v with fewer KV heads
  than ranks are replicated: rank ``r`` holds head group ``r // num_kv_head_replicas``.
  An HF tensor filling several outputs of a fused layer (Qwen3.5's ``in_proj_qkv`` -> outputs
  0-2 of ``in_proj_qkvz``, `engine_names.stacked_outputs`) is split by vLLM's loader into those
  outputs first, each then cut per rank: rank ``r`` holds ``r``'s part of q, of k and of v,
  several row ranges of the HF tensor, not one (read in 0.25.1 and 0.32.0
  ``MergedColumnParallelLinear.weight_loader(_v2)`` with a tuple shard id).
* a column-parallel layer whose weight loader is vLLM's ``mamba_v2_sharded_weight_loader``
  (Qwen3.5's ``conv1d`` over [q; k; v] channels): each part of its ``shard_spec`` cut per rank
  the same way (parts with ``extra`` padding are refused: not modelled).
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
Piece = tuple[int, int, int]
"""(dim, start, length) of a full HF tensor."""


def _layer(model: Any, hf_name: str) -> tuple[Any, str, str, str, list[str]] | None:
    """(vLLM layer, its fused name or "", HF projection, leaf, the fused layer's HF shards or
    []) holding HF tensor ``hf_name``; None if no such module."""
    from nemo_jetrl.vllm_patch.engine_names import engine_path

    module_path, _, leaf = engine_path(model, hf_name).rpartition(".")
    parent, _, proj = module_path.rpartition(".")
    for fused, shards in (getattr(model, "packed_modules_mapping", {}) or {}).items():
        if proj in shards:
            try:
                layer = model.get_submodule(f"{parent}.{fused}")
            except AttributeError:
                continue
            return layer, fused, proj, leaf, list(shards)
    try:
        return model.get_submodule(module_path), "", proj, leaf, []
    except AttributeError:
        return None


def _mamba_spec(layer: Any) -> list[tuple[int, int, bool]] | None:
    """The ``shard_spec`` of vLLM's ``mamba_v2_sharded_weight_loader`` set on ``layer.weight``
    ((full dim, extra, duplicate groups) per part), read from the loader's closure; None for
    any other loader."""
    loader = getattr(getattr(layer, "weight", None), "weight_loader", None)
    code = getattr(loader, "__code__", None)
    if code is None or "mamba_v2_sharded_weight_loader" not in getattr(loader, "__qualname__", ""):
        return None
    cells = dict(zip(code.co_freevars, loader.__closure__ or (), strict=False))
    spec = cells.get("shard_spec")
    return None if spec is None else [tuple(part) for part in spec.cell_contents]


def _mamba_pieces(
    hf_name: str, spec: list[tuple[int, int, bool]], tp: int, rank: int
) -> list[Piece]:
    pieces, boundary = [], 0
    for full_dim, extra, duplicate in spec:
        if extra:
            raise ValueError(
                f"{hf_name}: vLLM's mamba loader pads a part by {extra} rows on "
                f"tensor-parallel rank {rank} of {tp}: not modelled here"
            )
        size = int(full_dim) // tp
        pieces.append((0, boundary + (0 if duplicate else rank) * size, size))
        boundary += int(full_dim)
    return pieces


def _column_pieces(
    model: Any, layer: Any, fused: str, proj: str, shards: list[str], rank: int, qkv: bool
) -> list[Piece]:
    """Row ranges of the HF tensor ``proj`` a column-parallel ``layer`` holds on ``rank``."""
    from nemo_jetrl.vllm_patch.engine_names import stacked_outputs

    widths = [int(w) for w in layer.output_partition_sizes]
    if not shards:
        return [
            (0, rank * int(layer.output_size_per_partition), int(layer.output_size_per_partition))
        ]
    i = shards.index(proj)
    if qkv:  # k/v: replicated when kv heads < tp
        group = rank // int(getattr(layer, "num_kv_head_replicas", 1)) if i > 0 else rank
        return [(0, group * widths[i], widths[i])]
    pieces, offset = [], 0
    for o in stacked_outputs(model, proj, fused, i, len(widths)):
        pieces.append((0, offset + rank * widths[o], widths[o]))
        offset += widths[o] * int(layer.tp_size)  # the output's full width in the HF tensor
    return pieces


def _kinds() -> dict[str, type]:
    from vllm.model_executor.layers import linear, vocab_parallel_embedding

    return {
        "qkv": linear.QKVParallelLinear,
        "column": linear.ColumnParallelLinear,  # MergedColumnParallelLinear included
        "row": linear.RowParallelLinear,
        "vocab": vocab_parallel_embedding.VocabParallelEmbedding,  # ParallelLMHead included
    }


def dense_pieces(model: Any, hf_name: str, shape: tuple[int, ...]) -> list[Piece] | None:
    """The parts (dim, start, length) of the full HF tensor of ``shape`` named ``hf_name`` that
    this rank holds, in the order its parameter holds them (see the module docstring); None:
    the whole tensor (unsplit, or not a TP layer). A ``weight_scale_inv`` part is in blocks; one
    whose rows are not on 128-block edges is refused (ValueError naming the tensor)."""
    found = _layer(model, hf_name)
    if found is None or not shape:
        return None
    layer, fused, proj, leaf, shards = found
    tp, rank = int(getattr(layer, "tp_size", 1)), int(getattr(layer, "tp_rank", 0))
    if tp == 1 or leaf not in ("weight", "bias", SCALE):
        return None
    kinds = _kinds()
    if isinstance(layer, kinds["vocab"]):
        idx = layer.shard_indices
        start = int(idx.org_vocab_start_index)
        pieces = [(0, start, int(idx.org_vocab_end_index) - start)]
    elif isinstance(layer, kinds["row"]):
        if leaf == "bias":
            return None
        per = int(layer.input_size_per_partition)
        pieces = [(1, rank * per, per)]
    elif isinstance(layer, kinds["column"]):
        spec = _mamba_spec(layer) if leaf == "weight" and not shards else None
        if spec is not None:
            pieces = _mamba_pieces(hf_name, spec, tp, rank)
        else:
            qkv = isinstance(layer, kinds["qkv"])
            pieces = _column_pieces(model, layer, fused, proj, shards, rank, qkv)
    else:
        return None  # ReplicatedLinear, norms, ...
    return [_checked(hf_name, shape, leaf, p, rank, tp, type(layer).__name__) for p in pieces]


def _checked(
    hf_name: str, shape: tuple[int, ...], leaf: str, piece: Piece, rank: int, tp: int, kind: str
) -> Piece:
    """``piece`` within ``shape`` (a scale's in blocks), or ValueError naming the tensor."""
    dim, start, length = piece
    if start + length > shape[dim] * (WEIGHT_BLOCK[dim] if leaf == SCALE else 1):
        raise ValueError(
            f"{hf_name}: shape {shape} has no rows [{start}, {start + length}) in dim {dim} "
            f"for tensor-parallel rank {rank} of {tp} (vLLM's layer: {kind})"
        )
    if leaf != SCALE:
        return piece
    block = WEIGHT_BLOCK[dim]
    if start % block or length % block:
        raise ValueError(
            f"{hf_name}: tensor-parallel rank {rank} of {tp} holds [{start}, "
            f"{start + length}) of dim {dim}, not on {block}-blocks: its 128x128 FP8 "
            "blocks would not be training's"
        )
    return dim, start // block, length // block


def dense_slice(model: Any, hf_name: str, shape: tuple[int, ...]) -> Piece | None:
    """The one part of the full HF tensor this rank holds (`dense_pieces`); ValueError where
    it holds several."""
    pieces = dense_pieces(model, hf_name, shape)
    if pieces is not None and len(pieces) != 1:
        raise ValueError(f"{hf_name}: this rank holds {len(pieces)} parts: use dense_pieces")
    return None if pieces is None else pieces[0]


def rank_expected(model: Any, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full dense HF tensor ``tensor`` (a view for one part, the parts
    concatenated for several; the tensor itself when the rank holds it whole)."""
    pieces = dense_pieces(model, hf_name, tuple(tensor.shape))
    if pieces is None:
        return tensor
    parts = [tensor.narrow(dim, start, length) for dim, start, length in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces[0][0])


def engine_rows(layer: Any, leaf: str, rows: int) -> int:
    """Rows of the parameter ``leaf`` of ``layer`` that hold checkpoint data on this rank: a
    vocab-parallel layer's ``org_vocab`` shard (the rest is padding), else ``rows``."""
    idx = getattr(layer, "shard_indices", None)
    if leaf == "weight" and idx is not None:
        return int(idx.org_vocab_end_index) - int(idx.org_vocab_start_index)
    return rows
