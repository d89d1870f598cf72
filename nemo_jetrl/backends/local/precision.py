"""Build the trainer's and the rollout's copies of the model under a recipe's precision.

Both sides are the same HF model class built from the same config; they differ only in which
decoder linears are swapped for FP8 layers:

- training side, ``recipe.train.fp8_linears``: `Fp8BlockLinear` (TE blockwise recipe emulation:
  weights 128x128, activations 1x128, WGrad 128x1) via `convert_to_fp8_training`;
- rollout side, ``recipe.rollout.fp8_linears``: `Fp8InferenceLinear`, whose weight is quantized
  once per refit and whose activations are quantized per token (1x128). The quantizer is this
  package's (``rollout.quantizer`` "jetrl", what the patched vLLM runs) or an emulation of
  unpatched vLLM's own (``"vllm"``, used by the off-policy ``fp8_rollout`` recipe).

Which layers: decoder linears (``*_proj`` inside ``model.layers``) of the layers the side's
recipe marks FP8 (``bf16_first_layers`` / ``bf16_last_layers``), except those on its per-name
BF16 list (``bf16_layer_kws``, matched against the HF module name); embeddings, norms, attention
math and ``lm_head`` stay in the BF16 compute dtype on both sides. A linear whose dims fail TE's
FP8 rule (`fp8.spec.linear_dims_problem`: in % 16, out % 8; partial 128-blocks run) is kept BF16
by the converter and reported. MoE blocks are swapped on every
recipe (`moe.convert_moe_blocks`); their expert projections follow the same rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from nemo_jetrl.backends.local.moe import MoeHandle, convert_moe_blocks
from nemo_jetrl.fp8 import ConversionReport, Fp8LinearConfig, convert_to_fp8_inference
from nemo_jetrl.fp8 import convert_to_fp8_training as _convert_training
from nemo_jetrl.recipe import Recipe
from nemo_jetrl.recipe_parts import SideRecipe

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def side_fp8_config(side: SideRecipe, *, exact_gemm: bool = False) -> Fp8LinearConfig:
    """The `Fp8LinearConfig` of one side (format and scale mode). ``exact_gemm``: the GEMM whose
    per-tile sums are exact (order-free, so batch-invariant) instead of one fp32 matmul."""
    if side.pow2_weight_scales != side.pow2_activation_scales:
        raise ValueError(
            "the local backend needs one scale mode per side: set "
            "policy.generation.vllm_cfg.pow2_weight_scaling_factors and "
            "pow2_activation_scaling_factors to the same value"
        )
    if side.scaling != "blockwise":
        raise ValueError(
            f"the local backend emulates blockwise FP8 only, got scaling {side.scaling!r}: set "
            "policy.megatron_cfg.fp8_cfg.fp8_recipe=blockwise"
        )
    return Fp8LinearConfig(fmt=side.fmt, pow2_scales=side.pow2_weight_scales, exact_gemm=exact_gemm)


def fp8_filter(side: SideRecipe, num_layers: int):
    """``fn(module, name) -> bool``: True for decoder linears of this side's FP8 layers."""

    def accept(_module: nn.Module, name: str) -> bool:
        m = _LAYER_RE.search(name)
        if m is None or not name.rsplit(".", 1)[-1].endswith("_proj"):
            return False
        return side.is_fp8_linear(name, int(m.group(1)), num_layers)

    return accept


def rollout_quantizer(side: SideRecipe) -> str:
    """`Fp8InferenceLinear` quantizer for a rollout side: ours, or emulated vLLM's own."""
    return "vllm_native" if side.quantizer == "vllm" else "jetrl"


@dataclass(frozen=True)
class SidePlan:
    """What one side runs: the FP8 conversion report (None when the side is all BF16)."""

    fp8: ConversionReport | None
    config: Fp8LinearConfig | None
    quantizer: str | None
    moe: MoeHandle = field(default_factory=MoeHandle)
    """The MoE blocks swapped in (every recipe; empty for a dense model) and which expert
    projections run FP8."""


def make_trainer_model(model: nn.Module, recipe: Recipe, *, exact_gemm: bool = False) -> SidePlan:
    """Swap the training side's MoE blocks and FP8 linears in place (parameters are shared)."""
    side = recipe.train
    cfg = side_fp8_config(side, exact_gemm=exact_gemm) if side.fp8_linears else None
    moe = convert_moe_blocks(model, side, cfg)
    if cfg is None:
        return SidePlan(None, None, None, moe)
    n = model.config.num_hidden_layers
    report = _convert_training(model, cfg, module_filter_fn=fp8_filter(side, n))
    return SidePlan(report, cfg, "jetrl", moe)


def make_rollout_model(model: nn.Module, recipe: Recipe, *, exact_gemm: bool = False) -> SidePlan:
    """Swap the rollout side's MoE blocks and FP8 linears in place (weights quantized now;
    refit reloads)."""
    side = recipe.rollout
    cfg = side_fp8_config(side, exact_gemm=exact_gemm) if side.fp8_linears else None
    q = rollout_quantizer(side) if cfg is not None else None
    moe = convert_moe_blocks(model, side, cfg, quantizer=q or "jetrl")
    if cfg is None:
        return SidePlan(None, None, None, moe)
    n = model.config.num_hidden_layers
    report = convert_to_fp8_inference(model, cfg, module_filter_fn=fp8_filter(side, n), quantizer=q)
    return SidePlan(report, cfg, q, moe)


def freeze(model: nn.Module) -> nn.Module:
    """No gradients, eval mode (the rollout engine and the reference policy)."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def model_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]
