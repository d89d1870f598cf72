"""Mixture-of-experts under the blockwise recipe: Megatron-Core fields and Megatron -> HF names.

Config (`moe_transformer_fields`, read in megatron-core 0.16 ``transformer_config.py``):

- ``moe_router_dtype``: the router's GEMM, softmax and top-k run in fp32 (or fp64), never in the
  params dtype and never FP8 (the router is not a TE linear; ``RouterGatingLinearFunction``).
- ``moe_expert_capacity_factor=None`` and ``moe_pad_expert_input_to_capacity=False``: dropless.
  vLLM never drops a routed token, so a trainer that drops (or pads to capacity) computes another
  function than the rollout sampled from.
- ``moe_grouped_gemm=True``: TE's grouped linear (``TEGroupedMLP``). It runs inside the same
  ``fp8_autocast(recipe=Float8BlockScaling)`` as every other TE linear: one recipe, per expert
  1x128 activation and 128x128 weight blocks (what ``nemo_jetrl.fp8.experts`` reproduces).
  Expert GEMM dims must tile 128: ``moe_ffn_hidden_size`` and ``hidden_size``.
- ``expert_model_parallel_size`` / ``expert_tensor_parallel_size``: passed through (layout only).

Names (`moe_megatron_to_hf`), per decoder layer ``i`` and expert ``e`` (local index + the EP rank's
``expert_offset``); the rest goes through ``export.megatron_to_hf``:

=====================================================  ==============================================
Megatron                                               HuggingFace (per-expert checkpoint names)
=====================================================  ==============================================
``mlp.router.weight`` / ``mlp.router.expert_bias``     ``mlp.gate.weight`` / ``.e_score_correction_bias``
``mlp.experts.linear_fc1.weight{e}`` (TEGroupedMLP)    ``mlp.experts.{e}.gate_proj.weight``, ``up_proj``
``mlp.experts.local_experts.{e}.linear_fc1.weight``    the same (SequentialMLP)
``mlp.experts.linear_fc2.weight{e}`` / ``local_..fc2``  ``mlp.experts.{e}.down_proj.weight``
``mlp.shared_experts.linear_fc1/fc2.weight``           ``mlp.<shared>.{gate,up,down}_proj.weight``
``mlp.shared_experts.gate_weight``                     ``mlp.shared_expert_gate.weight`` (Qwen2-MoE)
=====================================================  ==============================================

``<shared>`` is ``shared_experts`` (DeepSeek-V3, Moonlight) or ``shared_expert`` (Qwen2-MoE).
Megatron's legacy ``GroupedMLP`` (``weight1``/``weight2``, all experts in one matrix) is refused.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nemo_jetrl.fp8 import BlockQuantized
from nemo_jetrl.fp8.spec import BLOCK
from nemo_jetrl.megatron.config import MegatronRecipeError, build_transformer_config
from nemo_jetrl.megatron.export import (
    _LAYER,
    ExportError,
    GptShape,
    _strip,
    fp8_weight_names,
    megatron_to_hf,
    quantize_hf,
    split_fused,
)
from nemo_jetrl.recipe import Recipe

KEY = "policy.megatron_cfg"
ROUTER_DTYPES = ("fp32", "fp64")
_EXPERT = re.compile(
    r"^mlp\.experts\.(?:linear_fc(?P<fc>[12])\.(?P<kind>weight|bias)(?P<e>\d+)"
    r"|local_experts\.(?P<e2>\d+)\.linear_fc(?P<fc2>[12])\.(?P<kind2>weight|bias))$"
)
_SHARED = re.compile(r"^mlp\.shared_experts\.linear_fc(?P<fc>[12])\.(?P<kind>weight|bias)$")
_ROUTER = {
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
_PROJS = ("gate_proj", "up_proj", "down_proj")


def moe_transformer_fields(
    recipe: Recipe,
    *,
    num_moe_experts: int,
    moe_router_topk: int,
    moe_ffn_hidden_size: int,
    hidden_size: int | None = None,
    moe_router_dtype: str | None = "fp32",
    moe_grouped_gemm: bool = True,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    moe_expert_capacity_factor: float | None = None,
    moe_pad_expert_input_to_capacity: bool = False,
) -> dict[str, Any]:
    """``TransformerConfig`` MoE fields for ``recipe``; MegatronRecipeError names each key that
    cannot be on-policy (capacity, router dtype, expert sizes, top-k, expert parallelism)."""
    problems = []
    if num_moe_experts < 2:
        problems.append(f"num_moe_experts={num_moe_experts}: an MoE layer needs >= 2 experts")
    if not 1 <= moe_router_topk <= num_moe_experts:
        problems.append(f"moe_router_topk={moe_router_topk}: must be in 1..{num_moe_experts}")
    if moe_router_dtype not in ROUTER_DTYPES:
        problems.append(
            f"{KEY}.moe_router_dtype={moe_router_dtype!r}: the router must run in fp32 or fp64 "
            "(its top-k decides the experts; never the params dtype)"
        )
    if moe_expert_capacity_factor is not None or moe_pad_expert_input_to_capacity:
        problems.append(
            f"{KEY}.moe_expert_capacity_factor={moe_expert_capacity_factor!r} / "
            f"moe_pad_expert_input_to_capacity={moe_pad_expert_input_to_capacity!r}: token "
            "dropping or capacity padding changes the function the rollout sampled from (vLLM "
            "never drops); set null / false"
        )
    ep = expert_model_parallel_size
    if ep < 1 or num_moe_experts % ep:
        problems.append(
            f"{KEY}.expert_model_parallel_size={ep} must divide num_moe_experts={num_moe_experts}"
        )
    if recipe.train.fp8_linears:
        dims = {"moe_ffn_hidden_size": moe_ffn_hidden_size, "hidden_size": hidden_size}
        problems += [
            f"{k}={v}: blockwise FP8 expert GEMMs need multiples of {BLOCK} (or BF16 experts)"
            for k, v in dims.items()
            if v is not None and v % BLOCK
        ]
    if problems:
        raise MegatronRecipeError("MoE under this recipe:\n  - " + "\n  - ".join(problems))
    return {
        "num_moe_experts": num_moe_experts,
        "moe_router_topk": moe_router_topk,
        "moe_ffn_hidden_size": moe_ffn_hidden_size,
        "moe_router_dtype": moe_router_dtype,
        "moe_grouped_gemm": moe_grouped_gemm,
        "moe_expert_capacity_factor": None,
        "moe_pad_expert_input_to_capacity": False,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": expert_tensor_parallel_size,
    }


def build_moe_transformer_config(
    recipe: Recipe, moe: Mapping[str, Any], **model_fields: Any
) -> Any:
    """A real ``TransformerConfig``: ``model_fields`` + the recipe's FP8 fields + the MoE fields
    of ``moe`` (`moe_transformer_fields` arguments)."""
    hidden = model_fields.get("hidden_size")
    fields = moe_transformer_fields(recipe, hidden_size=hidden, **moe)
    return build_transformer_config(recipe, **model_fields, **fields)


@dataclass(frozen=True)
class MoeShape:
    """What the expert name mapping needs beyond `GptShape`."""

    ffn_hidden_size: int
    """Per expert (``moe_ffn_hidden_size``)."""
    shared_ffn_hidden_size: int | None = None
    shared_expert: str = "shared_experts"
    """HF name of the shared expert MLP: ``shared_experts`` (DeepSeek) or ``shared_expert``."""
    expert_offset: int = 0
    """Global index of this expert-parallel rank's first expert."""


def _mlp(prefix: str, name: str, t: torch.Tensor, shape: GptShape, ffn: int) -> dict:
    """One fc1 (gate; up unfused by ``export.split_fused``) or fc2 tensor -> HF names."""
    kind = name.rsplit(".", 1)[-1].rstrip("0123456789")
    if ".linear_fc2." in name:
        return {f"{prefix}.down_proj.{kind}": t}
    unfused = split_fused(
        f"x.linear_fc1.{kind}", t, dataclasses.replace(shape, ffn_hidden_size=ffn)
    )
    return {f"{prefix}.{k.split('.', 1)[1]}": v for k, v in unfused.items()}


def moe_megatron_to_hf(
    state_dict: Mapping[str, torch.Tensor],
    shape: GptShape,
    moe: MoeShape,
    *,
    layer_offset: int = 0,
) -> dict[str, torch.Tensor]:
    """HF per-expert names for a Megatron MoE GPT's tensors (dtype unchanged; module docstring)."""
    dense: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for raw, t in state_dict.items():
        name = _strip(raw)
        m = _LAYER.match(name)
        suffix = m.group(2) if m else ""
        if m is None or not suffix.startswith(("mlp.router.", "mlp.experts.", "mlp.shared_")):
            dense[raw] = t
            continue
        if suffix.endswith("_extra_state"):
            continue
        pre = f"model.layers.{int(m.group(1)) + layer_offset}."
        if suffix in _ROUTER:
            out[pre + _ROUTER[suffix]] = t
        elif (e := _EXPERT.match(suffix)) is not None:
            local = int(e["e"] if e["e"] is not None else e["e2"])
            prefix = f"{pre}mlp.experts.{local + moe.expert_offset}"
            out.update(_mlp(prefix, suffix, t, shape, moe.ffn_hidden_size))
        elif _SHARED.match(suffix) is not None and moe.shared_ffn_hidden_size:
            prefix = f"{pre}mlp.{moe.shared_expert}"
            out.update(_mlp(prefix, suffix, t, shape, moe.shared_ffn_hidden_size))
        else:
            raise ExportError(
                f"{raw}: no HuggingFace name (Megatron's legacy GroupedMLP weight1/weight2 and "
                "shared experts without MoeShape.shared_ffn_hidden_size are not exported; use "
                "TE's grouped GEMM or SequentialMLP)"
            )
    return {**megatron_to_hf(dense, shape, layer_offset=layer_offset), **out}


def moe_fp8_weight_names(hf_names: list[str], recipe: Recipe, num_layers: int) -> list[str]:
    """The dense FP8 weights (``export.fp8_weight_names``) plus the experts' and shared experts'
    gate/up/down of the rollout's FP8 layers; routers never."""
    fp8_layers = set(recipe.rollout_fp8_layers(num_layers))
    kws = recipe.rollout.bf16_layer_kws
    pat = re.compile(
        r"^model\.layers\.(\d+)\.mlp\.(?:experts\.\d+|shared_experts?)\.(\w+)\.weight$"
    )
    out = fp8_weight_names(hf_names, recipe, num_layers)
    for n in hf_names:
        m = pat.match(n)
        on = m is not None and int(m.group(1)) in fp8_layers and m.group(2) in _PROJS
        if on and not any(kw in n for kw in kws):
            out.append(n)
    return out


def export_moe_hf(
    state_dict: Mapping[str, torch.Tensor],
    shape: GptShape,
    moe: MoeShape,
    recipe: Recipe,
    *,
    layer_offset: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[dict[str, torch.Tensor], dict[str, BlockQuantized]]:
    """``export.export_hf`` for an MoE model: every expert weight quantized on its own (128x128
    blocks inside one expert), with the dense path's quantizer (`export.quantize_hf`)."""
    hf = moe_megatron_to_hf(state_dict, shape, moe, layer_offset=layer_offset)
    fp8 = set(moe_fp8_weight_names(list(hf), recipe, shape.num_layers))
    return quantize_hf(hf, fp8, recipe, dtype)
