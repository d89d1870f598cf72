"""Per-tensor FP8 KV-cache quantization, exactly as vLLM writes and reads its cache.

An FP8 KV cache stores every key (and value) element as one FP8 E4M3 byte with a single fp32
scale per attention layer and tensor (``k_scale``, ``v_scale``; ``q_scale`` when the attention
kernel also takes FP8 queries). The scale is a *dequantization multiplier*: the cache holds
``x / scale`` and attention reads ``byte * scale``. The trainer calibrates the scales so that the
largest expected magnitude lands near the E4M3 maximum (448), see `calibration.py`.

Write, as vLLM's CUDA cache kernels do it (``reshape_and_cache_flash`` ->
``scaled_convert``: ``__nv_cvt_float_to_fp8(float(x) / scale, __NV_SATFINITE, E4M3)``)::

    v    = fp32(x) / fp32(scale)          # one IEEE round-to-nearest fp32 division
    byte = E4M3(v)                        # round to nearest, ties to even; |v| > 448 -> +-448
                                          # (+-inf -> +-448, NaN stays NaN)

Read::

    y = out_dtype(fp32(byte) * fp32(scale))   # one fp32 multiply, then one rounding to out_dtype

vLLM's CPU attention backend (``csrc/cpu/cpu_attn_fp8.hpp``, x86 AMX/VEC paths) writes the cache
differently: it multiplies by the fp32 reciprocal ``1/scale`` instead of dividing, clamps to
+-448, and then *truncates* the mantissa (rounds toward zero) instead of rounding to nearest.
``kernel="cpu"`` reproduces that; the default ``kernel="cuda"`` is what H100 rollouts run.

Fake quantization (``write`` then ``read``) is what both sides of an RL step apply when they want
the numbers an FP8 cache produces without storing bytes: the rollout applies it to what enters
its KV cache; with on-policy KV the trainer applies the same function with the same scales to its
post-RoPE keys/values, with a straight-through gradient (the rounding has zero derivative almost
everywhere, so the backward pass treats it as the identity). Fake quantization is idempotent for
outputs in fp32, bf16 or fp16: re-quantizing an already fake-quantized tensor returns the same
bits, so a cache holding fake-quantized values may be quantized again in attention harmlessly.

Depends on torch and `nemo_jetrl.fp8` only.
"""

from __future__ import annotations

from typing import Literal

import torch

from nemo_jetrl.fp8 import Fp8Format, get_format

Kernel = Literal["cuda", "cpu"]
KERNELS: tuple[str, ...] = ("cuda", "cpu")

# vLLM's CPU E5M2 encoder truncates: keep sign, exponent and the top 2 mantissa bits of the fp32
# value (normals), or truncate to the uniform subnormal grid below 2**-14.
_KEEP_MANTISSA_E5M2 = -2097152  # 0xFFE00000 as int32
_E5M2_MIN_NORMAL = 2.0**-14
_E5M2_SUBNORMAL_STEP = 2.0**-16


def rollout_cache_kernel(engine: str, platform: str = "cpu") -> Kernel:
    """The cache writer the trainer's fake quantization must mirror for a rollout ``engine``
    ("vllm" or our own "hf" rollout) on vLLM ``platform`` ("cpu" or "cuda").

    A vLLM CPU engine truncates (``cpu``); its CUDA engines and our HF rollout round to nearest
    (``cuda``: the HF rollout and the trainer apply the same function, so either would match;
    ``cuda`` is idempotent, so it is the one used there).
    """
    if engine not in ("vllm", "hf") or platform not in KERNELS:
        raise ValueError(
            f"rollout engine {engine!r} on {platform!r}: use engine 'vllm' or 'hf', platform "
            f"one of {KERNELS}"
        )
    return "cpu" if engine == "vllm" and platform == "cpu" else "cuda"


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(
            f"kernel={kernel!r}: use one of {KERNELS} (which vLLM cache writer to mimic)"
        )


def scale_tensor(
    scale: float | torch.Tensor, device: torch.device | str = "cpu", name: str = "scale"
) -> torch.Tensor:
    """A KV scale as a 0-d fp32 tensor on ``device``; refuses non-finite or non-positive ones.

    Never waits for a GPU: a Python number is checked on the host and written by a fill kernel
    (no host-to-device copy); a tensor on a GPU is checked there (``torch._assert_async``), so
    the trainer's on-policy KV costs no sync per attention call. The scale stays a tensor on
    ``x``'s device: CUDA divides by a CPU scalar as a multiply by its reciprocal, which is not
    vLLM's ``x / s``."""
    if not isinstance(scale, torch.Tensor):
        value = float(scale)
        _check_value(value, name)
        return torch.full((), value, dtype=torch.float32, device=device)
    if scale.numel() != 1:
        raise ValueError(
            f"{name}: a per-tensor KV scale must be one number, got shape {tuple(scale.shape)}"
        )
    s = scale.to(device=device, dtype=torch.float32).reshape(())
    if s.device.type == "cpu":
        _check_value(float(s), name)
    else:
        torch._assert_async(
            (s > 0.0) & torch.isfinite(s), f"{name}: a KV scale must be a finite positive number"
        )
    return s


def _check_value(value: float, name: str) -> None:
    if not (value > 0.0 and value != float("inf")):
        raise ValueError(
            f"{name}={value!r}: a KV scale must be a finite positive number "
            "(recalibrate, or keep the previous scale)"
        )


def quantize_kv(
    x: torch.Tensor,
    scale: float | torch.Tensor,
    *,
    fmt: str | Fp8Format = "e4m3",
    kernel: Kernel = "cuda",
) -> torch.Tensor:
    """What vLLM stores in its FP8 cache for ``x`` (an FP8 tensor of ``x``'s shape)."""
    _check_kernel(kernel)
    f = get_format(fmt)
    s = scale_tensor(scale, x.device)
    x32 = x.float()
    if kernel == "cuda":
        v = torch.clamp(torch.div(x32, s), -f.fmax, f.fmax)
        return v.to(f.dtype)  # torch's cast rounds to nearest even; clamped first = saturating
    # CPU kernel: multiply by the fp32 reciprocal, clamp (NaN -> +fmax, as std::min/max do),
    # then truncate the mantissa toward zero.
    v = torch.clamp(x32 * torch.reciprocal(s), -f.fmax, f.fmax)
    v = torch.where(torch.isnan(v), torch.full_like(v, f.fmax), v)
    if f.name == "e4m3":
        return _cpu_e4m3_bytes(v).view(f.dtype)
    normal = v.view(torch.int32).bitwise_and(_KEEP_MANTISSA_E5M2).view(torch.float32)
    sub = torch.trunc(v / _E5M2_SUBNORMAL_STEP) * _E5M2_SUBNORMAL_STEP  # exact: power of two
    t = torch.where(v.abs() >= _E5M2_MIN_NORMAL, normal, sub)
    return torch.where(v == 0, torch.zeros_like(t), t).to(f.dtype)  # exact: t is on the grid


def _cpu_e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU E4M3 encoder on clamped fp32 ``v``, as uint8.

    It rebiases the exponent by multiplying with 2**-120 (exact for E4M3 normals; values below
    2**-6 become fp32 subnormals, rounded to nearest even by that multiply), then keeps the low 4
    exponent bits and top 3 mantissa bits: truncation. Zero (either sign) encodes as +0.
    """
    u = (v * 2.0**-120).view(torch.int32)
    payload = torch.clamp((u >> 20) & 0x7F, max=0x7E)  # 0x7F is E4M3's NaN code
    sign = (u >> 24) & 0x80
    byte = torch.where(v == 0, torch.zeros_like(sign), sign | payload)
    return byte.to(torch.uint8)


def dequantize_kv(
    q: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """What attention reads back from the cache: ``dtype(fp32(q) * scale)``."""
    s = scale_tensor(scale, q.device)
    return (q.float() * s).to(dtype)


def fake_quantize_kv(
    x: torch.Tensor,
    scale: float | torch.Tensor,
    *,
    fmt: str | Fp8Format = "e4m3",
    kernel: Kernel = "cuda",
) -> torch.Tensor:
    """``read(write(x))`` in ``x``'s dtype: the values an FP8 KV cache gives back for ``x``."""
    return dequantize_kv(quantize_kv(x, scale, fmt=fmt, kernel=kernel), scale, x.dtype)


class _FakeQuantSTE(torch.autograd.Function):
    """Forward: FP8 KV fake quantization. Backward: identity (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x, scale, fmt, kernel):  # type: ignore[override]
        return fake_quantize_kv(x, scale, fmt=fmt, kernel=kernel)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        return grad_out, None, None, None


def fake_quantize_kv_ste(
    x: torch.Tensor,
    scale: float | torch.Tensor,
    *,
    fmt: str | Fp8Format = "e4m3",
    kernel: Kernel = "cuda",
) -> torch.Tensor:
    """`fake_quantize_kv` with a straight-through gradient (d out / d x = identity).

    Used by the trainer under on-policy KV: the forward sees exactly the rollout's cached values,
    the backward passes gradients to the unquantized keys/values unchanged (the scale is a
    calibrated constant and receives no gradient).
    """
    if not x.requires_grad:
        return fake_quantize_kv(x, scale, fmt=fmt, kernel=kernel)
    s = scale_tensor(scale, x.device)
    return _FakeQuantSTE.apply(x, s, get_format(fmt), kernel)
