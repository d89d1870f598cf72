"""The experts of one MoE block as the local backend runs them, per side and recipe.

An HF MoE block (transformers 5) stores its experts fused: ``experts.gate_up_proj`` ``[E, 2I, H]``
and ``experts.down_proj`` ``[E, H, I]``. `Experts` computes them on rows already sorted by expert
(``offsets [E+1]``: expert ``e`` owns rows ``offsets[e]:offsets[e+1]``), each projection in one of
three ways, chosen per projection by the side's FP8 rules (the dense linears' filters):

- BF16: the shared 3-D parameter, one torch GEMM per expert;
- FP8 training: the shared 3-D parameter through `nemo_jetrl.fp8.experts.grouped_fp8_linear`
  (per expert bit-exact to the dense path's `Fp8BlockLinearFunction`: 1x128 activations,
  128x128 weights, TE-order GEMM; WGrad blocks per expert);
- FP8 rollout: one `Fp8InferenceLinear` per expert (``gate_up_proj.<e>``), whose weight the refit
  quantizes once with the trainer's config (``jetrl``) or vLLM's emulated quantizer
  (``vllm_native``, the off-policy ``fp8_rollout``): the dense rollout layer, its load checks
  and its refit path, unchanged.

Between the projections: ``silu(gate) * up`` (`nemo_jetrl.invariant.ops.silu` when the block is
batch-invariant), as HF's experts compute it.
"""

from __future__ import annotations

import itertools
import re

import torch
from torch import nn

from nemo_jetrl.fp8 import Fp8InferenceLinear, Fp8LinearConfig
from nemo_jetrl.fp8.experts import grouped_fp8_linear
from nemo_jetrl.invariant import ops

PROJECTIONS = ("gate_up_proj", "down_proj")
# A rollout expert layer's name -> (its fused trainer tensor, expert index).
_EXPERT_LAYER = re.compile(r"^(.*\.experts\.(?:gate_up_proj|down_proj))\.(\d+)$")


def expert_rows(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(e, start, stop)`` of each expert with rows (CPU: the host read is free)."""
    bounds = offsets.tolist()
    return [(e, s, t) for e, (s, t) in enumerate(itertools.pairwise(bounds)) if t > s]


def _bf16_grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    outs = [nn.functional.linear(x[s:t], weight[e].to(x.dtype)) for e, s, t in expert_rows(offsets)]
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])


def fp8_dims_problem(weight: torch.Tensor) -> str | None:
    """Why a fused ``[E, N, K]`` expert weight cannot run 128x128-block FP8 (None: it can)."""
    mult = Fp8LinearConfig.DIM_MULTIPLE
    n, k = weight.shape[1:]
    return None if not (n % mult or k % mult) else f"dims ({n}, {k}) are not multiples of {mult}"


class Experts(nn.Module):
    """The experts of one block (see the module docstring). Built by `for_training` /
    `for_rollout`; ``gate_up_proj`` / ``down_proj`` keep HF's names, so state-dict keys and the
    refit's tensor names are the model's own."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.fp8: dict[str, Fp8LinearConfig] = {}
        self.invariant = False

    @classmethod
    def for_training(
        cls, hf_experts: nn.Module, name: str, fp8: dict[str, Fp8LinearConfig]
    ) -> Experts:
        """Sharing ``hf_experts``' parameters (optimizer state stays valid); ``fp8``: the
        projections that run FP8, with their config."""
        ex = cls(name)
        ex.gate_up_proj, ex.down_proj = hf_experts.gate_up_proj, hf_experts.down_proj
        ex.fp8 = dict(fp8)
        return ex

    @classmethod
    def for_rollout(
        cls, hf_experts: nn.Module, name: str, fp8: dict[str, Fp8LinearConfig], quantizer: str
    ) -> Experts:
        """FP8 projections become per-expert `Fp8InferenceLinear` layers quantized now (the refit
        reloads them); BF16 ones keep ``hf_experts``' parameter."""
        ex = cls(name)
        for which in PROJECTIONS:
            w = getattr(hf_experts, which)
            cfg = fp8.get(which)
            if cfg is None:
                setattr(ex, which, w)
                continue
            layers = nn.ModuleList()
            for e in range(w.shape[0]):
                layer = Fp8InferenceLinear(
                    w.shape[2], w.shape[1], False, config=cfg, quantizer=quantizer,
                    bias_dtype=w.dtype, name=f"{name}.{which}.{e}",
                )  # fmt: skip
                layer.load_weight(w[e].detach())
                layers.append(layer)
            setattr(ex, which, layers)
        return ex

    def _project(self, which: str, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        w = getattr(self, which)
        if isinstance(w, nn.ModuleList):
            outs = [w[e](x[s:t]) for e, s, t in expert_rows(offsets)]
            return torch.cat(outs) if outs else x.new_zeros(0, w[0].out_features)
        cfg = self.fp8.get(which)
        if cfg is not None:
            return grouped_fp8_linear(x, w, offsets, cfg, f"{self.name}.{which}")
        return _bf16_grouped(x, w, offsets)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``x [M, H]`` sorted by expert -> ``[M, H]``."""
        gate, up = self._project("gate_up_proj", x, offsets).chunk(2, dim=-1)
        act = ops.silu(gate) if self.invariant else nn.functional.silu(gate)
        return self._project("down_proj", act * up, offsets)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, fp8={sorted(self.fp8) or 'none'}"


def expert_layer_source(layer_name: str) -> tuple[str, int] | None:
    """For a rollout expert layer ``...experts.gate_up_proj.<e>``: (the fused trainer tensor's
    name, ``e``); None for any other layer."""
    m = _EXPERT_LAYER.match(layer_name)
    return None if m is None else (m.group(1), int(m.group(2)))
