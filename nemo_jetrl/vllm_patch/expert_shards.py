"""Routed experts split over vLLM ranks: tensor-parallel shards and expert-parallel placement.

What vLLM does (read in 0.20.0's ``FusedMoE`` and 0.32.0's ``RoutedExperts`` / ``MoERunner``):

* Tensor parallel without expert parallel: every rank holds every expert's slice of the
  intermediate dim ``I``: ``w13`` ``[E, 2*I/tp, H]`` (rank r's gate rows ``r*I/tp ..``, then its
  up rows), ``w2`` ``[E, H, I/tp]`` (columns), block scales ``[E, 2*I/tp/128, H/128]`` and
  ``[E, H/128, I/tp/128]``. The per-expert weight loader narrows an HF tensor and its
  ``weight_scale_inv`` along the same dim at ``r * size/tp`` (for 128-aligned shards this is
  the same 128x128 blocks, see `hf_slice`). A rank's down output is a partial sum over its
  slice; the MoE layer (0.20's ``FusedMoE`` / 0.32's ``MoERunner``), not the quant method,
  all-reduces it, so our kernel returns the partial sum exactly as vLLM's own kernels do.
* Expert parallel (``enable_expert_parallel``): the experts' ``tp_size`` is 1, ``ep_size`` is
  TP x DP and a rank holds whole experts; ``layer.expert_map[global] = local id``, ``-1`` for an
  expert held elsewhere; the loader skips non-local experts; the runner all-reduces as above.

FP8 bits: the gate/up input is the whole hidden row (training's 1x128 blocks); the down input's
1x128 blocks on a TP rank are slices of training's iff ``I/tp`` is a multiple of 128, and so are
the weights' 128x128 blocks. Only that is needed for the rollout's FP8 operands to be training's;
the partial sums and their all-reduce change the accumulation order, exactly as for a dense
row-parallel linear under TP. vLLM data parallel (DP > 1 inside one MoE group, NeMo-RL's
``expert_parallel_size > tensor_parallel_size``) is refused: not run.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import torch

from nemo_jetrl.fp8.experts_layer import sort_by_expert
from nemo_jetrl.fp8.spec import BLOCK, WEIGHT_BLOCK, linear_dims_problem
from nemo_jetrl.vllm_patch import dense_shards

EXPERT_NAME = re.compile(r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
# HF per-expert projection -> (vLLM parameter prefix, shard index within it)
EXPERT_SHARDS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}


_UNSPLIT = SimpleNamespace(tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, dp_size=1)


def parallel(layer: Any) -> Any:
    """The layer's ``FusedMoEParallelConfig`` (tp/ep/dp sizes and ranks of its experts); a
    module without one (not vLLM's) holds every expert whole."""
    cfg = getattr(getattr(layer, "moe_config", None), "moe_parallel_config", None)
    return _UNSPLIT if cfg is None else cfg


def shard_problems(layer: Any) -> list[str]:
    """Why our experts kernel cannot serve ``layer``'s split over ranks (empty: it can)."""
    moe, par = layer.moe_config, parallel(layer)
    problems = []
    i_part = int(moe.intermediate_size_per_partition)
    unpadded = getattr(moe, "intermediate_size_per_partition_unpadded", None) or i_part
    if par.tp_size > 1 and (i_part % WEIGHT_BLOCK[0] or unpadded != i_part):
        problems.append(
            f"tensor parallel {par.tp_size} gives each rank {unpadded} of the expert "
            f"intermediate size {unpadded * par.tp_size}, not a multiple of {WEIGHT_BLOCK[0]}: "
            "its 1x128/128x128 FP8 blocks would not be training's. Use expert parallel "
            "(vLLM enable_expert_parallel; NeMo-RL policy.generation.vllm_cfg."
            "expert_parallel_size = tensor_parallel_size) or a tensor_parallel_size dividing "
            f"{unpadded * par.tp_size // WEIGHT_BLOCK[0]}"
        )
    if par.dp_size > 1:
        problems.append(
            f"vLLM data parallel {par.dp_size} in the MoE layers (not run with our kernel; "
            "NeMo-RL sets it when vllm_cfg.expert_parallel_size > tensor_parallel_size: make "
            "them equal)"
        )
    if getattr(par, "pcp_size", 1) > 1:
        problems.append(f"prefill context parallel {par.pcp_size}")
    if getattr(par, "enable_eplb", False):
        problems.append("expert load balancing (enable_eplb)")
    return problems


def expert_map(layer: Any) -> torch.Tensor | None:
    """global -> local expert ids (``-1``: held by another rank); None without expert parallel."""
    m = getattr(layer, "_expert_map", None)
    if m is None:
        m = getattr(layer, "expert_map", None)
    return m if isinstance(m, torch.Tensor) and parallel(layer).ep_size > 1 else None


def local_expert(layer: Any, expert: int) -> int | None:
    """The local index of global expert ``expert`` on this rank (None: held elsewhere)."""
    m = expert_map(layer)
    if m is None:
        return expert
    local = int(m[expert])
    return local if local >= 0 else None


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s CUDA stream is capturing a CUDA graph (no host read allowed)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def local_routes(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, emap: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(local expert id, token, router weight fp32) per routed (token, expert) pair that this
    rank serves, flattened. With ``emap`` the ids are remapped and pairs for experts held
    elsewhere are dropped (one host read), or, while a CUDA graph is being captured (no host
    read allowed), kept on local expert 0 with router weight 0: computed, then added as 0."""
    m, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    token = torch.arange(m, device=topk_ids.device).repeat_interleave(k)
    weight = topk_weights.reshape(-1).float()
    if emap is None:
        return flat, token, weight
    flat = emap.to(flat.device)[flat].long()
    here = flat >= 0
    if capturing(topk_ids):
        return flat.clamp(min=0), token, weight * here
    return flat[here], token[here], weight[here]


def sorted_routes(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, emap: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`local_routes` sorted by local expert id (stable: token order inside an expert), as the
    grouped kernels read them: (expert ids, token, router weight fp32). Without ``emap`` every
    route is this rank's and a sorted row's token is its flat index // k (no token table built
    and gathered: 45 -> 40 ops per layer call, each a host dispatch in an eager prefill)."""
    if emap is None:
        by_expert, order, token = sort_by_expert(topk_ids)
        return by_expert, token, topk_weights.reshape(-1).float()[order]
    flat, token, weight = local_routes(topk_ids, topk_weights, emap)
    by_expert, order = torch.sort(flat, stable=True)
    return by_expert, token[order], weight[order]


def hf_slice(layer: Any, proj: str, full: tuple[int, ...]) -> tuple[int, int, int]:
    """(dim, start, length) of the HF per-expert tensor of shape ``full`` (``proj``'s
    ``weight`` [N, K] or ``weight_scale_inv`` [N/128, K/128]) that this rank holds, as vLLM's
    loader narrows it: gate/up rows, down columns, ``r * size/tp``."""
    tp, rank = parallel(layer).tp_size, parallel(layer).tp_rank
    dim = 1 if EXPERT_SHARDS[proj][0] == "w2" else 0
    per = full[dim] // tp
    return dim, rank * per, per


def split_expert_name(hf_name: str) -> tuple[str, int, str, str] | None:
    """``(experts path, global expert id, projection, leaf)`` of an HF per-expert tensor name
    (``model.layers.1.mlp.experts.3.up_proj.weight``); None for any other name."""
    m = EXPERT_NAME.match(hf_name)
    return None if m is None else (m[1], int(m[2]), m[3], m[4])


def experts_layer(model: Any, path: str) -> Any | None:
    """The module holding ``w13_weight`` for HF prefix ``path`` (``...mlp.experts``)."""
    from nemo_jetrl.vllm_patch.engine_names import engine_path

    try:
        layer = model.get_submodule(engine_path(model, path))
    except AttributeError:
        return None
    inner = getattr(layer, "routed_experts", None)  # 0.32: the runner holds RoutedExperts
    if not hasattr(layer, "w13_weight") and isinstance(inner, torch.nn.Module):
        layer = inner
    return layer if hasattr(layer, "w13_weight") else None


def rank_expected(model: Any, hf_name: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of the full HF tensor ``tensor`` named ``hf_name``: the shard vLLM's
    loader writes for a routed-expert tensor, None for an expert held by another rank, the
    dense tensor's shard on this tensor-parallel rank (``dense_shards``) for anything else."""
    parts = split_expert_name(hf_name)
    layer = experts_layer(model, parts[0]) if parts is not None else None
    if parts is None or layer is None:
        return dense_shards.rank_expected(model, hf_name, tensor)
    _, expert, proj, _ = parts
    if local_expert(layer, expert) is None:
        return None
    if parallel(layer).tp_size == 1 or tensor.dim() != 2:
        return tensor
    dim, start, length = hf_slice(layer, proj, tuple(tensor.shape))
    return tensor.narrow(dim, start, length)


def fused_dtype(model: Any, hf_name: str) -> torch.dtype | None:
    """The dtype of the fused parameter an HF per-expert tensor lands in, whether this rank
    holds that expert or another expert-parallel rank does (None: not a routed-expert tensor
    of this model, or an expert id beyond the layer's experts)."""
    parts = split_expert_name(hf_name)
    layer = experts_layer(model, parts[0]) if parts is not None else None
    if parts is None or layer is None:
        return None
    m = expert_map(layer)
    if parts[1] >= (len(m) if m is not None else layer.w13_weight.shape[0]):
        return None
    param = getattr(layer, f"{EXPERT_SHARDS[parts[2]][0]}_{parts[3]}", None)
    return param.dtype if isinstance(param, torch.Tensor) else None


def fp8_dims_problem(name: str, shape: torch.Size) -> str | None:
    """Why an FP8 weight sent as ``name`` cannot be refit (None: it can): TE's linear rule
    (partial 128-blocks run), but a routed expert needs whole blocks (vLLM stacks the experts,
    so each expert's blocks must start on a block edge)."""
    if EXPERT_NAME.match(name) and (shape[0] % BLOCK or shape[1] % BLOCK):
        return f"a routed expert's dims must be multiples of {BLOCK} (experts are stacked)"
    return linear_dims_problem(shape[1], shape[0])
