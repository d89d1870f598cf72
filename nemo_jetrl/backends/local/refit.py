"""Refit: the one guarded path that moves the trainer's weights into the rollout model.

Every step, before sampling, the rollout engine receives the weights the trainer will score
with. In two phases, so that a bad update can never reach the rollout:

1. stage: for every tensor the rollout model holds, take the trainer's tensor of the same name
   and check that it exists, has the expected shape and is finite. FP8 layers are quantized
   *here, once*, with 128x128 blocks: through `nemo_jetrl.fp8.quantize_blockwise` with the
   trainer's own `Fp8LinearConfig` (the exact call `Fp8BlockLinear` makes in its forward, so
   the rollout's FP8 weight equals the trainer's bit for bit), or, for a rollout that emulates
   unpatched vLLM, through vLLM's own weight quantizer (`vllm_native`). An MoE rollout's FP8
   expert layers (one per expert) take their expert's slice of the trainer's fused tensor.
   Each FP8 layer's quantized weight and bias also pass the layer's own load checks here
   (``Fp8InferenceLinear.stage_quantized``: FP8 bytes that are NaN, scales, blocks whose
   dequantized values overflow fp32, bias shape and finiteness).
2. commit: only when *every* tensor passed, store them all (FP8 layers via
   ``Fp8InferenceLinear.commit``: no requantization, nothing left to fail).

If anything fails, nothing is loaded: `RefitRefused` names every offending layer and the rollout
keeps its last good weights. The caller logs the refusal and carries on.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from nemo_jetrl.backends.local.moe_experts import expert_layer_source
from nemo_jetrl.fp8 import BlockQuantized, Fp8InferenceLinear, quantize_blockwise
from nemo_jetrl.fp8.staging import StagedWeight
from nemo_jetrl.fp8.vllm_native import per_block_cast_native


class RefitRefused(RuntimeError):
    """The trainer's weights were refused; ``problems`` lists one message per bad tensor."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        head = f"refit refused ({len(problems)} problem{'s' if len(problems) != 1 else ''}); "
        super().__init__(
            head
            + "the rollout keeps its last good weights:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


@dataclass
class RefitResult:
    """What one refit did."""

    seconds: float
    tensors: int
    fp8_layers: int
    quantized: dict[str, BlockQuantized] = field(default_factory=dict)


def export_weights(trainer_model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's weights as the rollout would receive them (detached, no copy)."""
    return {k: v.detach() for k, v in trainer_model.state_dict().items()}


def quantize_for_rollout(layer: Fp8InferenceLinear, weight: torch.Tensor) -> BlockQuantized:
    """Quantize ``weight`` 128x128 exactly as ``layer``'s quantizer and config say."""
    cfg = layer.config
    name = f"{layer.name}.weight"
    if layer.quantizer == "vllm_native":
        return per_block_cast_native(weight, ue8m0=cfg.pow2_scales, name=name)
    return quantize_blockwise(
        weight,
        cfg.WEIGHT_BLOCK,
        fmt=cfg.forward_format,
        pow2_scales=cfg.pow2_scales,
        eps=cfg.eps,
        name=name,
    )


def _check(name: str, t: torch.Tensor | None, shape: tuple[int, ...]) -> str | None:
    if t is None:
        return f"{name}: missing from the trainer's weights"
    if tuple(t.shape) != shape:
        return f"{name}: shape {tuple(t.shape)} but the rollout model expects {shape}"
    if not t.is_floating_point():
        return f"{name}: dtype {t.dtype} is not a floating-point weight"
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        return (
            f"{name}: {int(bad.sum())} non-finite value(s) (first {float(t[idx])} at {list(idx)}); "
            "the update that produced it diverged"
        )
    return None


@dataclass
class StagedRefit:
    """Every tensor of one refit, checked and ready to store (`stage_refit` -> `commit_refit`)."""

    fp8_layers: dict[str, Fp8InferenceLinear]
    """The rollout model's FP8 layers by module name."""
    fp8: dict[str, tuple[BlockQuantized, StagedWeight]]
    """Per FP8 layer: its 128x128 quantization and what its own load checks accepted."""
    plain: list[tuple[torch.Tensor, torch.Tensor]]
    """(parameter, new value already cast to its dtype) for every other parameter."""
    t0: float
    """When staging began (`time.perf_counter`), for the refit's duration."""


def _stage_fp8(
    layers: Mapping[str, Fp8InferenceLinear],
    weights: Mapping[str, torch.Tensor],
    problems: list[str],
) -> dict[str, tuple[BlockQuantized, StagedWeight]]:
    staged: dict[str, tuple[BlockQuantized, StagedWeight]] = {}
    for name, layer in layers.items():
        w = weights.get(f"{name}.weight")
        msg = _check(f"{name}.weight", w, (layer.out_features, layer.in_features))
        b = weights.get(f"{name}.bias") if layer.bias is not None else None
        if msg is None and layer.bias is not None:
            msg = _check(f"{name}.bias", b, (layer.out_features,))
        if msg is not None:
            problems.append(msg)
            continue
        assert w is not None
        try:  # the quantizer refuses non-finite input; the layer makes every load check now
            q = quantize_for_rollout(layer, w)
            staged[name] = (q, layer.stage_quantized(q.data, q.scale_inv, b))
        except (ValueError, TypeError) as exc:
            problems.append(str(exc))
    return staged


def _expert_slices(
    layers: Mapping[str, Fp8InferenceLinear], weights: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``<layer>.weight`` for each rollout expert layer (``...experts.gate_up_proj.<e>``): expert
    ``e``'s slice of the trainer's fused 3-D tensor (views, no copy)."""
    out: dict[str, torch.Tensor] = {}
    for name in layers:
        src = expert_layer_source(name)
        fused = None if src is None else weights.get(src[0])
        if fused is not None and fused.dim() == 3 and src[1] < fused.shape[0]:  # type: ignore[index]
            out[f"{name}.weight"] = fused[src[1]]  # type: ignore[index]
    return out


@torch.no_grad()
def stage_refit(rollout_model: nn.Module, weights: Mapping[str, torch.Tensor]) -> StagedRefit:
    """Phase 1 (module doc): check and quantize every tensor, store nothing. `RefitRefused`
    names every problem."""
    t0 = time.perf_counter()
    problems: list[str] = []
    fp8_layers: dict[str, Fp8InferenceLinear] = {
        n: m for n, m in rollout_model.named_modules() if isinstance(m, Fp8InferenceLinear)
    }
    staged_fp8 = _stage_fp8(
        fp8_layers, {**weights, **_expert_slices(fp8_layers, weights)}, problems
    )
    fp8_prefixes = tuple(f"{n}." for n in fp8_layers)
    staged_plain: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, param in rollout_model.named_parameters():
        if name.startswith(fp8_prefixes):
            continue
        src = weights.get(name)
        msg = _check(name, src, tuple(param.shape))
        if msg is None:
            src = src.to(param.dtype)  # type: ignore[union-attr]
            if not bool(torch.isfinite(src).all()):
                msg = f"{name}: finite values overflow the rollout's {param.dtype} (inf after cast)"
        if msg is not None:
            problems.append(msg)
        else:
            staged_plain.append((param, src))  # type: ignore[arg-type]
    if problems:
        raise RefitRefused(problems)
    return StagedRefit(fp8_layers, staged_fp8, staged_plain, t0)


@torch.no_grad()
def commit_refit(staged: StagedRefit) -> RefitResult:
    """Phase 2: store what `stage_refit` accepted (nothing left that can fail)."""
    for name, (_, weight) in staged.fp8.items():
        staged.fp8_layers[name].commit(weight)
    for param, src in staged.plain:
        param.copy_(src)
    return RefitResult(
        seconds=time.perf_counter() - staged.t0,
        tensors=len(staged.plain) + len(staged.fp8),
        fp8_layers=len(staged.fp8),
        quantized={n: q for n, (q, _) in staged.fp8.items()},
    )


def refit(rollout_model: nn.Module, weights: Mapping[str, torch.Tensor]) -> RefitResult:
    """Load ``weights`` (trainer names) into ``rollout_model`` through the guard (see module doc).

    Raises `RefitRefused` (nothing loaded) when any tensor is missing, mis-shaped or non-finite.
    """
    return commit_refit(stage_refit(rollout_model, weights))
