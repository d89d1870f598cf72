"""BF16 linears on a CPU, computed as float64 GEMMs of the BF16 values (on CUDA a
batch-invariant run puts them on the invariant matmul instead: `needs_invariant_gemm`).

A BF16 GEMM multiplies BF16 operands, accumulates in float32 and rounds the result once to BF16
(what GPU tensor cores and oneDNN's BF16 kernels do). On a CPU without BF16 hardware (AVX2;
AVX-512 without AVX512_BF16/AMX) torch has no fast BF16 GEMM and falls back to a scalar loop: a
``[448, 512] x [512, 256]`` product took 91 ms there against 4.4 ms as float64 (2-core AMD EPYC),
and a BF16 GRPO step of the demo spent most of its time in it.

Two BF16 values have 8-bit significands, so their product is exact in float32 and in float64.
The forward sums the products in float64 and rounds to float32, then to BF16. Why float64 and not
a float32 GEMM (2x faster): the BLAS picks its kernel, and so its summation order, by the number
of rows, and a float32 sum's last bit follows the order: a ``[M, 256] x [256, 256]`` GEMM's
first rows differed from the same rows inside ``M = 448`` in 1,019 float32 values over 44 row
counts, where the float64 sums differed in none (MKL, AVX2). Rounded to BF16 such a difference
survives about once in 2**16, so a decode step (few rows) and the trainer's forward (many) would
still disagree now and then on a BF16-kept layer. A float64 sum of these products is exact
while their exponents span less than ~28 bits, and otherwise a different order moves it by at
most K * 2**-53 relative, which must then cross a float32 and a BF16 rounding boundary to show.
Not batch-invariant by construction (the local backend's batch-invariant ops are ``lm_head``
and the FP8 GEMMs, `nemo_jetrl.invariant`), but far from the float32 GEMM's odds.

One path on every CPU, BF16 hardware or not, so the bits match across CPUs on the same odds
(torch's BF16 kernels differ by CPU), at a cost not measured yet where torch's BF16 GEMM is fast
(AMX), on the local backend's small models.

The backward (not part of the on-policy promise) is `nemo_jetrl.invariant.backward.linear_grads`,
as for the batch-invariant ``lm_head``: float32 GEMMs, each gradient rounded once to its dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from nemo_jetrl.invariant.backward import linear_grads
from nemo_jetrl.invariant.hf import lm_head_only


def float32_sums(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The forward's float32 result before its BF16 rounding: float64 sums, rounded once."""
    b = bias.double() if bias is not None else None
    return nn.functional.linear(x.double(), weight.double(), b).float()


class _Bf16Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return float32_sums(x, weight, bias).to(x.dtype)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return linear_grads(ctx, g)


def runs_here(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True where this GEMM replaces torch's: BF16 operands on a CPU."""
    return x.device.type == "cpu" and x.dtype == weight.dtype == torch.bfloat16


def needs_invariant_gemm(device: torch.device) -> bool:
    """Whether a batch-invariant model's BF16 linears on ``device`` must run the invariant
    matmul (`nemo_jetrl.invariant.ops.linear`): on CUDA, where torch's GEMM (cuBLAS) picks its
    kernel, split-K included, by the row count, so a decode step's rows and the trainer's
    forward would sum in other orders. On a CPU the float64 path here is used instead (the
    invariant linear's torch form holds rows x N x K products: for ``lm_head`` only)."""
    return device.type == "cuda"


def invariant_linears(device: torch.device) -> Callable[[str, nn.Linear], bool]:
    """The ``linear_filter`` of `make_batch_invariant` for a model on ``device``: on CUDA every
    linear the FP8 conversion left (BF16-kept decoder linears too, `needs_invariant_gemm`), on a
    CPU ``lm_head`` only (the rest then go to `swap_bf16_linears`)."""
    if needs_invariant_gemm(device):
        return lambda _name, _module: True
    return lm_head_only


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
    """True for a linear whose GEMM is not batch-invariant by construction: a plain
    ``nn.Linear`` (torch's GEMM, any dtype) or a `Bf16CpuLinear`."""
    return type(module) is nn.Linear or isinstance(module, Bf16CpuLinear)
