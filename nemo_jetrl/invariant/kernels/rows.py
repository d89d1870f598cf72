"""Per-row reductions in Triton for the invariant ops: RMSNorm's ``rstd`` and log-softmax's
``(max, log sum exp)``, one program per row, the row reduced in an order set by its length alone.

`ops.rms_norm` and `ops.log_softmax` take only the reduction from here and keep their elementwise
tail in torch (``weight * (x * rstd).to(dtype)``, ``(x - max) - log_sum``): IEEE ``+ - * /`` are
correctly rounded on CUDA, so the tail is batch-invariant as written and the semantics stay those
of the torch path. The reduction order (read `_jit_rows`) depends on ``block`` and the row length
only: ``block`` is a fixed launch constant, never chosen from the number of rows, so a row has the
same bits in a batch of 1 or of 8192, in a decode step or in a training forward.

Each kernel has a float64 torch reference beside it (`rms_rstd_reference`,
`log_softmax_reference`) that the tests measure it against; the kernels never call them. The
backward (`RmsRstd`, `LogSumExp`) is torch's: it is not part of the on-policy promise.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from nemo_jetrl.fp8._deps import require
from nemo_jetrl.fp8.triton_launch import NO_FTZ, frozen_meta, launch

ROW_BLOCK = 1024
"""Lanes per row (each keeps its own fp32 partial); fixed, so the order depends on the row length."""
ROW_WARPS = 4
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _jit() -> ModuleType:
    require("triton", feature="the batch-invariant Triton kernels")
    from nemo_jetrl.invariant.kernels import _jit_rows

    return _jit_rows


@functools.cache
def _meta(block: int, dtype: torch.dtype) -> dict:
    """A row kernel's constexprs and options, built once per setting (`triton_launch.launch`
    calls the compiled launcher directly after the first launch)."""
    return frozen_meta(BLOCK=block, IN_BF16=dtype == torch.bfloat16, num_warps=ROW_WARPS, **NO_FTZ)


def _rows(x: torch.Tensor, label: str) -> torch.Tensor:
    if x.dtype not in ROW_DTYPES:
        raise ValueError(f"{label}: dtype {x.dtype} is not one of {ROW_DTYPES}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    # bf16 goes in as its bit pattern: the kernel widens it exactly (`to_fp32`).
    return x2.view(torch.int16) if x2.dtype == torch.bfloat16 else x2


def rms_rstd(x: torch.Tensor, eps: float, *, block: int = ROW_BLOCK) -> torch.Tensor:
    """fp32 ``1 / sqrt(mean(x**2, -1) + eps)`` of ``x [..., H]``, shape ``[..., 1]`` (no grad)."""
    x2 = _rows(x, "rms_norm input")
    out = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        h = x.shape[-1]
        args = (x2, out, h, float(h), x2.stride(0), float(eps))
        launch(_jit().rms_rstd_kernel, (x2.shape[0],), args, _meta(block, x.dtype))
    return out.reshape(*x.shape[:-1], 1)


def logsumexp_parts(
    x: torch.Tensor, *, block: int = ROW_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(max, log(sum(exp(x - max))))`` over the last dim of ``x``, each ``[..., 1]``."""
    x2 = _rows(x, "log_softmax input")
    n = x2.shape[0]
    mx = torch.empty(n, dtype=torch.float32, device=x.device)
    log_sum = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        args = (x2, mx, log_sum, x.shape[-1], x2.stride(0))
        launch(_jit().logsumexp_kernel, (n,), args, _meta(block, x.dtype))
    lead = x.shape[:-1]
    return mx.reshape(*lead, 1), log_sum.reshape(*lead, 1)


class RmsRstd(torch.autograd.Function):
    """`rms_rstd` with its gradient: ``d rstd / dx = -rstd**3 * x / H``."""

    @staticmethod
    def forward(ctx, x, eps):  # type: ignore[override]
        rstd = rms_rstd(x, eps)
        ctx.save_for_backward(x, rstd)
        return rstd

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, rstd = ctx.saved_tensors
        dx = g * (-(rstd**3)) * x.float() / x.shape[-1]
        return dx.to(x.dtype), None


class LogSumExp(torch.autograd.Function):
    """`logsumexp_parts` of fp32 ``x``; the max is a constant (its gradient cancels in
    ``(x - max) - log_sum``), ``d log_sum / dx = softmax(x)``."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        mx, log_sum = logsumexp_parts(x)
        ctx.save_for_backward(x, mx, log_sum)
        ctx.mark_non_differentiable(mx)
        return mx, log_sum

    @staticmethod
    def backward(ctx, _gmax, g):  # type: ignore[override]
        x, mx, log_sum = ctx.saved_tensors
        return g * torch.exp(x - mx - log_sum)


def rms_rstd_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 ``rstd`` of ``x`` (``[..., 1]``): what `rms_rstd` approximates."""
    xd = x.double()
    return 1.0 / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps)


def log_softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """float64 log-softmax over the last dim."""
    return torch.log_softmax(x.double(), dim=-1)
