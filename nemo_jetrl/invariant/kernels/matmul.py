"""``x @ w.T`` in Triton with a reduction order fixed per feature dimension: the invariant
`ops.linear` on CUDA (``lm_head``, the MoE router, BF16 linears).

Tile sizes (``BM x BN``, ``BK``) are launch constants, never chosen from M: a row's output runs
through the same ``BM``-row tile shape and the same K steps (``0, BK, 2 BK, ...``, each a
``tl.dot`` into one fp32 accumulator) whatever the number of rows, with no split-K and no
autotuning (read `_jit_matmul`). bf16/fp16 operands multiply exactly into fp32; fp32 operands use
IEEE fp32 products (not TF32). A mixed pair (fp32 activations, bf16 weight) is widened to fp32
(exact). The output is fp32; `ops.linear` adds the bias and casts, elementwise.

`matmul_reference` (float64) is what the tests measure the kernel against; the kernel never calls
it. The backward (`Matmul`) uses torch's GEMMs: it is not part of the on-policy promise.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from nemo_jetrl.fp8._deps import require
from nemo_jetrl.fp8.triton_launch import frozen_meta, interpreting, launch

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
MATMUL_WARPS = 4
MATMUL_STAGES = 2
MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _jit() -> ModuleType:
    require("triton", feature="the batch-invariant Triton kernels")
    from nemo_jetrl.invariant.kernels import _jit_matmul

    return _jit_matmul


def _operands(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    for label, t in (("linear input", x), ("linear weight", w)):
        if t.dtype not in MATMUL_DTYPES:
            raise ValueError(f"{label}: dtype {t.dtype} is not one of {MATMUL_DTYPES}")
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"linear: input [..., {x.shape[-1]}] and weight {list(w.shape)} do not match "
            "(weight must be [out_features, in_features])"
        )
    if x.dtype != w.dtype:  # widen both to fp32: exact for bf16/fp16 values
        return x.float(), w.float()
    return x, w


def matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
) -> torch.Tensor:
    """fp32 ``x @ w.T`` for ``x [..., K]`` and ``w [N, K]``, shape ``[..., N]`` (no grad)."""
    a, b = _operands(x, w)
    a2 = a.reshape(-1, a.shape[-1])
    m, k = a2.shape
    n = b.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m and n:
        grid = (_cdiv(m, block_m), _cdiv(n, block_n))
        args = (a2, b, out, m, n, k, a2.stride(0), a2.stride(1), b.stride(0), b.stride(1),
                out.stride(0), out.stride(1))  # fmt: skip
        meta = _meta(block_m, block_n, block_k, a2.dtype == torch.float32, interpreting(),
                     MATMUL_WARPS, MATMUL_STAGES)  # fmt: skip
        launch(_jit().matmul_kernel, grid, args, meta)
    return out.reshape(*x.shape[:-1], n)


@functools.cache
def _meta(bm: int, bn: int, bk: int, ieee: bool, ordered: bool, warps: int, stages: int) -> dict:
    """The kernel's constexprs and options, built once per setting (`triton_launch.launch`)."""
    return frozen_meta(BM=bm, BN=bn, BK=bk, IEEE=ieee, ORDERED=ordered, num_warps=warps,
                       num_stages=stages)  # fmt: skip


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Matmul(torch.autograd.Function):
    """`matmul` forward; torch's GEMMs for the backward (fp32, cast back to each input dtype)."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return matmul(x, w)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1]).float()
        dx = (g2 @ w.float()).to(x.dtype).reshape(x.shape)
        dw = (g2.t() @ x.reshape(-1, x.shape[-1]).float()).to(w.dtype)
        return dx, dw


def matmul_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 ``x @ w.T``."""
    return x.double() @ w.double().t()
