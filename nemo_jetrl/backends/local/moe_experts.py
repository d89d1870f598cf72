"""The experts of one MoE block as the local backend runs them, per side and recipe.

An HF MoE block (transformers 5) stores its experts fused: ``experts.gate_up_proj`` ``[E, 2I, H]``
and ``experts.down_proj`` ``[E, H, I]``. `Experts` computes them on the routed rows sorted by
expert (``rows [R]``: each row's token in ``x [T, H]``; ``offsets [E+1]``: expert ``e`` owns rows
``offsets[e]:offsets[e+1]``), each projection in one of three ways, chosen per projection by the
side's FP8 rules (the dense linears' filters):

- BF16: the shared 3-D parameter, one torch GEMM per expert;
- FP8 training: the shared 3-D parameter through `nemo_jetrl.fp8.experts.grouped_fp8_linear`
  (per expert bit-exact to the dense path's `Fp8BlockLinearFunction`: 1x128 activations,
  128x128 weights, TE-order GEMM; WGrad blocks per expert);
- FP8 rollout: one `Fp8InferenceLinear` per expert (``gate_up_proj.<e>``) holds the weight the
  refit quantizes once with the trainer's config (``jetrl``) or vLLM's emulated quantizer
  (``vllm_native``, the off-policy ``fp8_rollout``): the dense rollout layer's load checks and
  refit path, unchanged. With ``jetrl`` the layers' bytes are stacked (once per refit) into
  `GroupedQuantizedWeights` and computed grouped, no per-expert loop: both projections FP8 run
  `fp8.experts_layer.routed_experts_inference` (tokens quantized once and gathered as FP8,
  SiLU*up fused with the down projection's quantization), one alone
  `grouped_fp8_linear_inference`. ``vllm_native`` keeps one layer call per expert (vLLM's own
  quantizer, emulated).

Between the projections: ``silu(gate) * up``. Where the down projection is FP8 it is
`nemo_jetrl.fp8.silu_mul.silu_mul` on both sides (the serving kernel's rule: SiLU in fp32 from a
portable exp, rounded to the model dtype, the product rounded once; bit-equal to
`nemo_jetrl.invariant.ops.silu` times up), so a fused rollout and the trainer keep equal bits;
where it is BF16, HF's ``silu(gate) * up`` (`invariant.ops.silu` when batch-invariant).
"""

from __future__ import annotations

import itertools
import re

import torch
from torch import nn

from nemo_jetrl.backends.local import bf16_gemm
from nemo_jetrl.fp8 import Fp8InferenceLinear, Fp8LinearConfig
from nemo_jetrl.fp8.experts import grouped_fp8_linear, grouped_fp8_linear_inference
from nemo_jetrl.fp8.experts_layer import routed_experts_inference
from nemo_jetrl.fp8.grouped_tensors import GroupedQuantizedWeights
from nemo_jetrl.fp8.silu_mul import silu_mul
from nemo_jetrl.invariant import ops

PROJECTIONS = ("gate_up_proj", "down_proj")
# A rollout expert layer's name -> (its fused trainer tensor, expert index).
_EXPERT_LAYER = re.compile(r"^(.*\.experts\.(?:gate_up_proj|down_proj))\.(\d+)$")


def expert_rows(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(e, start, stop)`` of each expert with rows (CPU: the host read is free)."""
    bounds = offsets.tolist()
    return [(e, s, t) for e, (s, t) in enumerate(itertools.pairwise(bounds)) if t > s]


def _bf16_grouped(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, invariant: bool
) -> torch.Tensor:
    # each expert's row count changes with the batch: on CUDA torch's GEMM picks its kernel by
    # it, so a batch-invariant block multiplies with the invariant matmul there
    lin = ops.linear if invariant and bf16_gemm.needs_invariant_gemm(x.device) else bf16_gemm.linear
    outs = [lin(x[s:t], weight[e].to(x.dtype)) for e, s, t in expert_rows(offsets)]
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
        self._stacks: dict[str, tuple[tuple[int, ...], GroupedQuantizedWeights]] = {}

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
                    bias_dtype=w.dtype, name=f"{name}.{which}.{e}", device=w.device,
                )  # fmt: skip
                layer.load_weight(w[e].detach())
                layers.append(layer)
            setattr(ex, which, layers)
        return ex

    def _stacked(self, which: str) -> GroupedQuantizedWeights | None:
        """A ``jetrl`` rollout projection's per-expert bytes as one grouped weight, restacked
        only when a refit wrote them (the buffers' versions); None for any other projection."""
        layers = getattr(self, which)
        if not isinstance(layers, nn.ModuleList) or layers[0].quantizer != "jetrl":
            return None
        for layer in layers:
            if not layer.loaded:
                raise RuntimeError(f"{layer.name}: no weight loaded; call load_weight() first")
        key = tuple(b._version for m in layers for b in (m.weight_fp8, m.weight_scale_inv))
        cached = self._stacks.get(which)
        if cached is None or cached[0] != key:
            cfg = layers[0].config
            data = torch.stack([m.weight_fp8 for m in layers])
            scale = torch.stack([m.weight_scale_inv for m in layers])
            q = GroupedQuantizedWeights(data, scale, cfg.forward_format.name, cfg.pow2_scales)
            cached = self._stacks[which] = (key, q)
        return cached[1]

    def _project(self, which: str, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        w = getattr(self, which)
        stacked = self._stacked(which)
        if stacked is not None:
            cfg = w[0].config
            return grouped_fp8_linear_inference(x, stacked, offsets, cfg, f"{self.name}.{which}")
        if isinstance(w, nn.ModuleList):  # vllm_native: the emulated vLLM quantizer per expert
            outs = [w[e](x[s:t]) for e, s, t in expert_rows(offsets)]
            return torch.cat(outs) if outs else x.new_zeros(0, w[0].out_features)
        cfg = self.fp8.get(which)
        if cfg is not None:
            return grouped_fp8_linear(x, w, offsets, cfg, f"{self.name}.{which}")
        return _bf16_grouped(x, w, offsets, self.invariant)

    def _down_fp8(self) -> bool:
        return isinstance(self.down_proj, nn.ModuleList) or "down_proj" in self.fp8

    def forward(self, x: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``rows [R]`` (each routed row's token, sorted by expert) -> ``[R, H]``."""
        q13, q2 = self._stacked("gate_up_proj"), self._stacked("down_proj")
        if q13 is not None and q2 is not None:
            cfg = self.gate_up_proj[0].config
            return routed_experts_inference(x, rows, offsets, q13, q2, cfg, self.name)
        gate, up = self._project("gate_up_proj", x[rows], offsets).chunk(2, dim=-1)
        if self._down_fp8():
            act = silu_mul(gate, up)
        else:
            act = (ops.silu(gate) if self.invariant else nn.functional.silu(gate)) * up
        return self._project("down_proj", act, offsets)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, fp8={sorted(self.fp8) or 'none'}"


def expert_layer_source(layer_name: str) -> tuple[str, int] | None:
    """For a rollout expert layer ``...experts.gate_up_proj.<e>``: (the fused trainer tensor's
    name, ``e``); None for any other layer."""
    m = _EXPERT_LAYER.match(layer_name)
    return None if m is None else (m.group(1), int(m.group(2)))
