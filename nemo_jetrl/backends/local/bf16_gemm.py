"""BF16 linears on a CPU, computed as float32 GEMMs of the BF16 values.

A BF16 GEMM multiplies BF16 operands, accumulates in float32 and rounds the result once to BF16
(what GPU tensor cores and oneDNN's BF16 kernels do). Two BF16 values have 8-bit significands, so
their product is exact in float32; a float32 GEMM of the same values, rounded once to BF16, keeps
that contract. On a CPU without BF16 hardware (AVX2; AVX-512 without AVX512_BF16/AMX) torch has
no fast BF16 GEMM and falls back to a scalar loop: a ``[448, 512] x [512, 256]`` product took
91 ms there against 2.1 ms as float32 (2-core AMD EPYC), and a BF16 GRPO step of the demo spent
most of its time in it. The sums' order is the float32 GEMM's (BLAS blocking), as torch's own
BF16 kernels' order is theirs: like them, this GEMM is not batch-invariant (the local backend's
batch-invariant ops cover ``lm_head`` and the FP8 GEMMs, not the BF16 decoder linears).

The backward is the same contract: float32 GEMMs of the BF16 gradient and operands, each
gradient rounded once to its tensor's dtype.
"""

from __future__ import annotations

import torch
from torch import nn


class _Bf16Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        b = bias.float() if bias is not None else None
        return nn.functional.linear(x.float(), weight.float(), b).to(x.dtype)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1]).float()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (g2 @ weight.float()).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dw = (g2.t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.sum(0).to(weight.dtype)
        return dx, dw, db


def runs_here(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True where this GEMM replaces torch's: BF16 operands on a CPU."""
    return x.device.type == "cpu" and x.dtype == weight.dtype == torch.bfloat16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``nn.functional.linear`` with BF16 CPU operands computed as described above; any other
    dtype or device goes to torch unchanged."""
    if runs_here(x, weight):
        return _Bf16Linear.apply(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


class Bf16CpuLinear(nn.Module):
    """``nn.Linear`` sharing the replaced layer's ``weight``/``bias`` (state-dict names and
    refit unchanged), computed by `linear`."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight = layer.weight
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def swap_bf16_linears(model: nn.Module) -> list[str]:
    """Replace every plain ``nn.Linear`` of ``model`` whose weight is BF16 on a CPU (what the FP8
    conversion and the batch-invariant swap left: BF16 decoder linears, ``lm_head`` when not
    invariant) by `Bf16CpuLinear`, in place. Returns the names replaced."""
    names = []
    for parent_name, parent in list(model.named_modules()):
        for attr, child in list(parent.named_children()):
            w = getattr(child, "weight", None)
            if type(child) is nn.Linear and w is not None and runs_here(w, w):
                setattr(parent, attr, Bf16CpuLinear(child))
                names.append(f"{parent_name}.{attr}" if parent_name else attr)
    return names


def is_bf16_gemm(module: nn.Module) -> bool:
    """True for a linear that runs a BF16 (batch-variant) GEMM: a plain ``nn.Linear`` or a
    `Bf16CpuLinear`."""
    return type(module) is nn.Linear or isinstance(module, Bf16CpuLinear)
