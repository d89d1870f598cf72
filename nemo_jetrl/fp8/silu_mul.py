"""SiLU(gate) * up between an MoE expert's two projections: one rule for training and rollout.

The rule (what `silu_mul` computes and the fused Triton kernel
`triton_grouped.silu_mul_quantize` reproduces bit for bit):

1. ``s = gate / (1 + exp(-gate))`` in fp32 from the model-dtype ``gate``, rounded once to the
   model dtype (bf16, fp16; fp32 models keep fp32): today's ``F.silu`` precision (torch computes SiLU in fp32 and
   rounds to the tensor's dtype);
2. ``act = s * up`` as an fp32 product of the two model-dtype values (exact: 2 x 8 significand
   bits fit fp32's 24), rounded once to the model dtype: today's ``silu(gate) * up`` precision;
3. the down projection quantizes ``act`` 1x128 (the activation quantizer's spec, from the
   rounded ``act``).

``exp`` is not torch's: torch's transcendental kernels take a SIMD path for most elements and
libm for a tensor's tail, and CUDA's ``expf`` differs from both, so ``F.silu`` can move a bit with
the tensor's shape or device. `portable_exp` is built from correctly rounded fp32 ``+ - * /`` and
round-half-even only (Cody-Waite reduction, degree-7 Taylor polynomial, two power-of-two
factors), so a Triton kernel, torch on any CPU and torch on CUDA compute the same bits. It is
the same rule, constant for constant, as ``nemo_jetrl.invariant.ops.exp`` (the local backend's
batch-invariant SiLU; fp8/ imports nothing else of the package, so it is written out here and a
test holds the two equal bit for bit). Its error is within 2 ulp of fp32 ``e**x``.

The backward of `silu_mul` is ordinary fp32 calculus (``ds/dg = sig * (1 + g * (1 - sig))``):
gradients are not part of the rollout, so only the forward's bits are pinned.
"""

from __future__ import annotations

import struct

import torch

from nemo_jetrl.fp8.formats import Fp8Format
from nemo_jetrl.fp8.quantize import BlockQuantized, quantize_reference
from nemo_jetrl.fp8.spec import ACTIVATION_BLOCK


def _f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


# fp32 constants (the values torch uses when an fp32 tensor meets these Python floats).
LOG2E = _f32(1.4426950408889634)
LN2_HI = 0.693359375  # n * LN2_HI exact in fp32 for |n| < 2**15 (Cody-Waite)
LN2_LO = _f32(-2.12194440e-4)
EXP_MAX = _f32(88.72283)  # above: fp32 overflow
EXP_MIN = _f32(-103.97208)  # below: under half the smallest subnormal, rounds to 0
# Horner coefficients, highest first: 1/5040, then 1/720 ... 1, 1.
TAYLOR = tuple(_f32(c) for c in (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 0.5, 1.0, 1.0))
MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the kernel's MODEL codes


def _pow2(k: torch.Tensor) -> torch.Tensor:
    return ((k + 127) << 23).to(torch.int32).view(torch.float32)


def portable_exp(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``e**x`` from correctly rounded elementwise ops only (see the module docstring)."""
    x = x.float()
    xc = x.clamp(EXP_MIN, EXP_MAX)
    n = torch.round(xc * LOG2E)
    r = (xc - n * LN2_HI) - n * LN2_LO
    p = torch.full_like(r, TAYLOR[0])
    for c in TAYLOR[1:]:
        p = p * r + c
    k = n.to(torch.int32).clamp(-252, 254)
    half = torch.div(k, 2, rounding_mode="floor")
    y = (p * _pow2(half)) * _pow2(k - half)
    y = torch.where(x > EXP_MAX, torch.full_like(y, float("inf")), y)
    y = torch.where(x < EXP_MIN, torch.zeros_like(y), y)
    return torch.where(torch.isnan(x), x, y)


def _silu_mul_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.float()
    s = (g / (1.0 + portable_exp(-g))).to(gate.dtype)
    return (s.float() * up.float()).to(gate.dtype)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return _silu_mul_forward(gate, up)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        g, u, d = gate.float(), up.float(), dy.float()
        sig = torch.sigmoid(g)
        s = g * sig
        dgate = d * u * sig * (1.0 + g * (1.0 - sig))
        return dgate.to(gate.dtype), (d * s).to(up.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` by the rule above (model dtype in and out; differentiable)."""
    if gate.dtype not in MODEL_DTYPES or up.dtype != gate.dtype or gate.shape != up.shape:
        raise TypeError(
            f"silu_mul: gate and up must be bf16/fp16/fp32 of one dtype and shape, got {gate.dtype} "
            f"{tuple(gate.shape)} and {up.dtype} {tuple(up.shape)}"
        )
    return _SiluMul.apply(gate, up)


def silu_mul_quantize_reference(
    gate_up: torch.Tensor, *, fmt: Fp8Format, pow2_scales: bool, eps: float, name: str,
    check_finite: bool = True,
) -> BlockQuantized:  # fmt: skip
    """The unfused reference of `triton_grouped.silu_mul_quantize`: ``gate_up [M, 2I]`` (gate
    columns first) -> `silu_mul` -> the 1x128 quantization of ``[M, I]`` (the kernel never
    calls this)."""
    gate, up = gate_up.chunk(2, dim=-1)
    act = silu_mul(gate, up)
    return quantize_reference(
        act, ACTIVATION_BLOCK, fmt=fmt, pow2_scales=pow2_scales, eps=eps, name=name,
        check_finite=check_finite,
    )  # fmt: skip
