"""Megatron-Core parameters -> HuggingFace names and FP8 (data, scale_inv) for refit.

Names. A Megatron GPTModel (Llama/Qwen2/Qwen3 families) stores per decoder layer ``i``:

==========================================================  =========================================
Megatron                                                    HuggingFace
==========================================================  =========================================
``embedding.word_embeddings.weight``                        ``model.embed_tokens.weight``
``decoder.layers.i.input_layernorm.weight`` (local spec)    ``model.layers.i.input_layernorm.weight``
``...self_attention.linear_qkv.layer_norm_weight`` (TE)     ``model.layers.i.input_layernorm.weight``
``...self_attention.linear_qkv.weight`` / ``.bias``         ``...self_attn.{q,k,v}_proj.weight/.bias``
``...self_attention.q_layernorm.weight`` / ``k_layernorm``  ``...self_attn.q_norm.weight`` / ``k_norm``
``...self_attention.linear_proj.weight``                    ``...self_attn.o_proj.weight``
``decoder.layers.i.pre_mlp_layernorm.weight`` (local)       ``...post_attention_layernorm.weight``
``...mlp.linear_fc1.layer_norm_weight`` (TE)                ``...post_attention_layernorm.weight``
``...mlp.linear_fc1.weight``                                ``...mlp.gate_proj.weight``, ``up_proj``
``...mlp.linear_fc2.weight``                                ``...mlp.down_proj.weight``
``decoder.final_layernorm.weight``                          ``model.norm.weight``
``output_layer.weight``                                     ``lm_head.weight``
==========================================================  =========================================

Fusions. ``linear_qkv`` interleaves per KV group ``g``: rows ``[q heads of g (npg*hd) | k_g (hd)
| v_g (hd)]`` for ``g = 0..ng-1`` (``npg`` query heads per group, ``hd`` head dim); HF keeps
``q_proj`` (all query heads in order), ``k_proj``, ``v_proj`` separate. ``linear_fc1`` is
``[gate; up]`` stacked along rows (SwiGLU).

FP8 for refit. The rollout engine holds the *HF* weights (re-fused by vLLM, each shard with its
own block scales), so what matters is ``quantize_blockwise(hf_weight, (128, 128))`` of every
unfused FP8 weight in the rollout's scale rule: `export_hf` (MoE: ``moe.export_moe_hf``).

From TE's own FP8 weights (``fp8_param``). TE quantized the *fused* Megatron weight in 128x128
blocks with the same formula. When every fused boundary falls on a 128-row boundary (``hd`` and the
FFN size multiples of 128, true for Llama/Qwen at 8B), each HF weight's blocks are a subset of TE's
blocks with identical contents, so re-laying out TE's rowwise data and scales (padding dropped,
rows regrouped) gives bit for bit the same (data, scale_inv) as quantizing the unfused master
weight. `te_fp8_to_hf` does that re-layout; `parity_check` compares the two paths and names every
tensor that differs. Where a boundary (or a tensor-parallel shard edge) is not aligned, TE's
training blocks are not the rollout's on either path: `blocks.block_layout_problems` refuses it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from nemo_jetrl.fp8 import BlockQuantized, quantize_blockwise
from nemo_jetrl.fp8.layouts import TeBlockwiseTensor, from_te
from nemo_jetrl.fp8.spec import BLOCK
from nemo_jetrl.megatron.parity import parity_check as parity_check
from nemo_jetrl.recipe import Recipe

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Per-layer Megatron suffix -> HF suffix (after "model.layers.{i}.") for 1:1 tensors.
_LAYER_MAP: Mapping[str, str] = MappingProxyType(
    {
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
        "mlp.linear_fc2.bias": "mlp.down_proj.bias",
    }
)
_GLOBAL_MAP: Mapping[str, str] = MappingProxyType(
    {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
)
# HF linear weights of a decoder layer that can be FP8 (the rest stays BF16 on both sides).
FP8_LINEARS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


class ExportError(ValueError):
    """A parameter that cannot be exported; the message names it and says why."""


@dataclass(frozen=True)
class GptShape:
    """The dimensions the name mapping and the unfusing need."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    gated_linear_unit: bool = True

    @property
    def qkv_rows(self) -> int:
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @staticmethod
    def from_megatron_config(cfg: Any) -> GptShape:
        """From a Megatron ``TransformerConfig`` (TP=1 view: the full, unsharded model)."""
        groups = cfg.num_query_groups or cfg.num_attention_heads
        return GptShape(
            num_layers=cfg.num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_query_groups=groups,
            head_dim=cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads,
            ffn_hidden_size=cfg.ffn_hidden_size,
            gated_linear_unit=bool(cfg.gated_linear_unit),
        )

    def qkv_row_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """Rows of the fused ``linear_qkv`` that make up HF q, k and v, in HF order."""
        hd, npg = self.head_dim, self.heads_per_group
        per_group = (npg + 2) * hd
        out: dict[str, list[tuple[int, int]]] = {"q": [], "k": [], "v": []}
        for g in range(self.num_query_groups):
            base = g * per_group
            out["q"].append((base, base + npg * hd))
            out["k"].append((base + npg * hd, base + (npg + 1) * hd))
            out["v"].append((base + (npg + 1) * hd, base + per_group))
        return out

    def fc1_row_ranges(self) -> dict[str, list[tuple[int, int]]]:
        f = self.ffn_hidden_size
        return {"gate": [(0, f)], "up": [(f, 2 * f)]}


def _strip(name: str) -> str:
    return re.sub(r"^(?:module\.)+", "", name)


def _take_rows(t: torch.Tensor, ranges: Iterable[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t[a:b] for a, b in ranges], dim=0)


def split_fused(name: str, t: torch.Tensor, shape: GptShape) -> dict[str, torch.Tensor]:
    """Unfuse one ``linear_qkv`` / ``linear_fc1`` weight or bias into HF suffixes."""
    kind = "weight" if name.endswith(".weight") else "bias"
    if ".linear_qkv." in name:
        ranges = shape.qkv_row_ranges()
        rows = shape.qkv_rows
        if t.shape[0] != rows:
            raise ExportError(
                f"{name}: {t.shape[0]} rows, expected (heads + 2*groups) * head_dim = {rows}; "
                "export the full (tensor-parallel gathered) weight"
            )
        return {f"self_attn.{p}_proj.{kind}": _take_rows(t, ranges[p]) for p in "qkv"}
    if ".linear_fc1." in name:
        if not shape.gated_linear_unit:
            return {f"mlp.up_proj.{kind}": t}
        if t.shape[0] != 2 * shape.ffn_hidden_size:
            raise ExportError(
                f"{name}: {t.shape[0]} rows, expected 2 * ffn_hidden_size = "
                f"{2 * shape.ffn_hidden_size} (gate and up stacked)"
            )
        ranges = shape.fc1_row_ranges()
        return {f"mlp.{p}_proj.{kind}": _take_rows(t, ranges[p]) for p in ("gate", "up")}
    raise ExportError(f"{name} is not a fused linear_qkv / linear_fc1 tensor")


def full_shape_problem(name: str, dims: tuple[int, ...], shape: GptShape) -> str | None:
    """Why a decoder linear weight of ``dims`` is not the full model's (a tensor-parallel shard:
    rows of ``linear_qkv``/``linear_fc1``, input columns of ``linear_proj``/``linear_fc2``)."""
    fc1 = shape.ffn_hidden_size * (2 if shape.gated_linear_unit else 1)
    want = {
        "linear_qkv": (0, shape.qkv_rows, "rows"),
        "linear_fc1": (0, fc1, "rows"),
        "linear_proj": (1, shape.num_attention_heads * shape.head_dim, "input columns"),
        "linear_fc2": (1, shape.ffn_hidden_size, "input columns"),
    }
    m = re.search(r"(?:self_attention|mlp)\.(linear_\w+)\.weight$", name)
    if m is None or m.group(1) not in want or len(dims) != 2:
        return None
    axis, need, what = want[m.group(1)]
    if dims[axis] == need:
        return None
    return (
        f"{name}: {dims[axis]} {what}, the full model has {need}: a tensor-parallel shard (TE "
        "quantized it in its own blocks); export the full (tensor-parallel gathered) weight"
    )


def megatron_to_hf(
    state_dict: Mapping[str, torch.Tensor], shape: GptShape, *, layer_offset: int = 0
) -> dict[str, torch.Tensor]:
    """HF-named, unfused tensors (dtype unchanged). Unknown parameters are an error naming them.

    ``layer_offset`` is the pipeline stage's first global layer; TE's ``_extra_state`` entries
    are skipped.
    """
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for raw, t in state_dict.items():
        name = _strip(raw)
        if name.endswith("_extra_state"):
            continue
        if name in _GLOBAL_MAP:
            out[_GLOBAL_MAP[name]] = t
            continue
        m = _LAYER.match(name)
        if m is None:
            unknown.append(raw)
            continue
        layer, suffix = int(m.group(1)) + layer_offset, m.group(2)
        prefix = f"model.layers.{layer}."
        if suffix in _LAYER_MAP:
            if why := full_shape_problem(name, tuple(t.shape), shape):
                raise ExportError(why)
            out[prefix + _LAYER_MAP[suffix]] = t
        elif suffix.startswith(
            ("self_attention.linear_qkv.", "mlp.linear_fc1.")
        ) and suffix.endswith((".weight", ".bias")):
            for hf_suffix, part in split_fused(name, t, shape).items():
                out[prefix + hf_suffix] = part
        else:
            unknown.append(raw)
    if unknown:
        raise ExportError(
            "no HuggingFace name for Megatron parameter(s): "
            + ", ".join(unknown[:10])
            + (" ..." if len(unknown) > 10 else "")
            + " (supported: Llama/Qwen2/Qwen3-style dense GPT models)"
        )
    return out


def _layer_of(hf_name: str) -> int | None:
    return int(m.group(1)) if (m := re.match(r"^model\.layers\.(\d+)\.", hf_name)) else None


def fp8_weight_names(hf_names: Iterable[str], recipe: Recipe, num_layers: int) -> list[str]:
    """The HF weights the rollout holds in FP8 under ``recipe`` (its rollout side)."""
    fp8_layers = set(recipe.rollout_fp8_layers(num_layers))
    out = []
    for n in hf_names:
        layer = _layer_of(n)
        if layer is not None and layer in fp8_layers and n.split(".", 3)[3] in FP8_LINEARS:
            out.append(n)
    return out


def scale_inv_name(weight_name: str) -> str:
    """vLLM's name for a block-FP8 weight's scales: ``...weight`` -> ``...weight_scale_inv``."""
    if not weight_name.endswith(".weight"):
        raise ExportError(f"{weight_name} is not a weight")
    return weight_name + "_scale_inv"


def export_hf(
    state_dict: Mapping[str, torch.Tensor],
    shape: GptShape,
    recipe: Recipe,
    *,
    layer_offset: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[dict[str, torch.Tensor], dict[str, BlockQuantized]]:
    """Refit payload from master weights: ``(tensors, quantized)``. ``tensors``: the flat HF dict
    an engine loads, FP8 weights as float8 data plus ``*.weight_scale_inv`` (fp32, compact
    ``[ceil(N/128), ceil(K/128)]``, vLLM's layout), the rest in ``dtype``; ``quantized``: the FP8
    weights as `BlockQuantized` (128x128 blocks, E4M3, the rollout side's weight scale rule)."""
    hf = megatron_to_hf(state_dict, shape, layer_offset=layer_offset)
    return quantize_hf(hf, set(fp8_weight_names(hf, recipe, shape.num_layers)), recipe, dtype)


def quantize_hf(
    hf: Mapping[str, torch.Tensor], fp8_names: set[str], recipe: Recipe, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, BlockQuantized]]:
    """`export_hf`'s payload from HF-named tensors: ``fp8_names`` quantized (rollout's rule)."""
    pow2 = recipe.rollout.pow2_weight_scales
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, BlockQuantized] = {}
    for name, t in hf.items():
        if name in fp8_names:
            q = quantize_blockwise(
                t.detach(), (BLOCK, BLOCK), fmt="e4m3", pow2_scales=pow2, name=name
            )
            quantized[name] = q
            tensors[name] = q.data
            tensors[scale_inv_name(name)] = q.scale_inv
        else:
            tensors[name] = t.detach().to(dtype)
    return tensors, quantized


def _rows_of_blocks(q: BlockQuantized, ranges: list[tuple[int, int]], what: str) -> BlockQuantized:
    for a, b in ranges:
        if a % BLOCK or (b % BLOCK and b != q.data.shape[0]):
            raise ExportError(
                f"{what}: rows [{a}, {b}) of TE's fused FP8 weight do not start and end on "
                f"{BLOCK}-row block boundaries, so TE's 128x128 blocks straddle two HF weights "
                "(training's blocks are not the rollout's: blocks.block_layout_problems)"
            )
    data = torch.cat([q.data[a:b] for a, b in ranges], dim=0)
    scale = torch.cat([q.scale_inv[a // BLOCK : -(-b // BLOCK)] for a, b in ranges], dim=0)
    return BlockQuantized(data, scale.contiguous(), q.block, q.fmt, q.pow2_scales)


def te_fp8_to_hf(
    megatron_name: str,
    te: TeBlockwiseTensor,
    shape: GptShape,
    *,
    pow2_scales: bool,
    fmt: str = "e4m3",
    layer_offset: int = 0,
) -> dict[str, BlockQuantized]:
    """Re-lay out one of TE's FP8 weights (rowwise 128x128 data + padded scales) to HF weights.

    Returns ``{hf_name: BlockQuantized}`` (compact layout); see the module docstring for when
    this is exact. Raises ExportError for unaligned fused boundaries or non-2-D TE scaling.
    """
    if not te.is_2D_scaled or te.rowwise_data is None:
        raise ExportError(
            f"{megatron_name}: TE weight is not 128x128 block scaled with rowwise data "
            f"(is_2D_scaled={te.is_2D_scaled}); blockwise FP8 weights need w_block_scaling_dim=2"
        )
    q, _ = from_te(te, fmt=fmt, pow2_scales=pow2_scales)
    assert q is not None
    name = _strip(megatron_name)
    m = _LAYER.match(name)
    if m is None:
        raise ExportError(f"{megatron_name}: not a decoder-layer weight")
    if why := full_shape_problem(name, tuple(te.shape), shape):
        raise ExportError(why)
    prefix = f"model.layers.{int(m.group(1)) + layer_offset}."
    suffix = m.group(2)
    if suffix == "self_attention.linear_qkv.weight":
        ranges = shape.qkv_row_ranges()
        return {
            f"{prefix}self_attn.{p}_proj.weight": _rows_of_blocks(
                q, ranges[p], f"{megatron_name} ({p})"
            )
            for p in "qkv"
        }
    if suffix == "mlp.linear_fc1.weight" and shape.gated_linear_unit:
        ranges = shape.fc1_row_ranges()
        return {
            f"{prefix}mlp.{p}_proj.weight": _rows_of_blocks(q, ranges[p], f"{megatron_name} ({p})")
            for p in ("gate", "up")
        }
    if suffix in _LAYER_MAP or suffix == "mlp.linear_fc1.weight":
        hf_suffix = _LAYER_MAP.get(suffix, "mlp.up_proj.weight")
        return {prefix + hf_suffix: q}
    raise ExportError(f"{megatron_name}: no HF weight for this TE FP8 parameter")


def te_storage_of(param: Any) -> TeBlockwiseTensor:
    """The storage of a TE ``Float8BlockwiseQTensor`` parameter (GPU, TE installed)."""
    needed = ("_rowwise_data", "_rowwise_scale_inv", "_is_2D_scaled")
    missing = [a for a in needed if not hasattr(param, a)]
    if missing:
        raise ExportError(
            f"parameter of type {type(param).__name__} is not a TE Float8BlockwiseQTensor "
            f"(missing {missing}); is fp8_param on with fp8_recipe=blockwise?"
        )
    shape = tuple(param.shape)
    return TeBlockwiseTensor(
        shape=(shape[0], shape[1]),
        is_2D_scaled=bool(param._is_2D_scaled),
        rowwise_data=param._rowwise_data,
        rowwise_scale_inv=param._rowwise_scale_inv,
        columnwise_data=getattr(param, "_columnwise_data", None),
        columnwise_scale_inv=getattr(param, "_columnwise_scale_inv", None),
    )


def export_te_fp8_params(
    model: torch.nn.Module, shape: GptShape, recipe: Recipe, *, layer_offset: int = 0
) -> dict[str, BlockQuantized]:
    """HF-named FP8 weights straight from a TE model's FP8 parameters (``fp8_param``)."""
    pow2 = recipe.train.pow2_weight_scales
    out: dict[str, BlockQuantized] = {}
    for name, p in model.named_parameters():
        if hasattr(p, "_rowwise_data") and hasattr(p, "_is_2D_scaled"):
            out.update(
                te_fp8_to_hf(
                    name, te_storage_of(p), shape, pow2_scales=pow2, layer_offset=layer_offset
                )
            )
    wanted = set(fp8_weight_names(out, recipe, shape.num_layers))
    return {k: v for k, v in out.items() if k in wanted}
