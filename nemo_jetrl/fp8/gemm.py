"""Blockwise-scaled FP8 GEMM: ``a @ b.T`` where both operands carry one scale per 128-wide K block.

Convention: both operands are given **with the reduction dim last** (``a`` is ``[M, K]``, ``b`` is
``[N, K]``, the "NT" layout of cuBLAS/DeepGEMM), each blocked along K with 128-wide blocks:
block ``(1, 128)`` (one scale per row and K block) or ``(128, 128)`` (one scale per 128 rows and K
block). The three GEMMs of a linear layer map onto this as follows::

    FProp  y  = x  @ W.T   a = x   (1x128)            b = W     (128x128)
    DGrad  dx = dy @ W     a = dy  (1x128)            b = W.t() (128x128: the same blocks)
    WGrad  dW = dy.T @ x   a = dyc.t()                b = xc.t()
                           where dyc, xc are quantized (128x1): 128 tokens per block. Their
                           .t() is (1x128) blocked along the token dim, which is the reduction.

Math. For output element (m, n), K is cut into tiles of 128 (the last may be shorter)::

    out[m, n] = sum_t  sa[m, t] * sb[n, t] * sum_{k in tile t} qa[m, k] * qb[n, k]

``exact=True`` computes exactly that, as TE/DeepGEMM do on Hopper: the inner sum of FP8 products
(each product is exact in fp32: 4x4 significant bits) is accumulated in fp32 per tile, then scaled
by ``sa * sb`` (an fp32 product) and added to an fp32 accumulator. ``exact=False`` dequantizes
both operands to fp32 and does one fp32 matmul: faster on CPU, different rounding. Both are within
``K * 2**-24 * (|A| @ |B|.T)`` of the float64 product of the dequantized operands (the usual
recursive-summation bound with unit roundoff 2**-24), so they differ by at most twice that.
GEMM output bits are not part of the on-policy promise (only the quantized *inputs* are).
"""

from __future__ import annotations

import torch

from nemo_jetrl.fp8.quantize import BlockQuantized

TILE_K = 128


def _row_scales(q: BlockQuantized, rows: int) -> torch.Tensor:
    """Per-row scales ``[rows, Kt]``: repeat a 128-row block's scale over its rows."""
    bm = q.block[0]
    s = q.scale_inv.float()
    return s if bm == 1 else s.repeat_interleave(bm, dim=0)[:rows]


def _check(a: BlockQuantized, b: BlockQuantized) -> None:
    for label, q in (("a", a), ("b", b)):
        if not isinstance(q, BlockQuantized):
            raise TypeError(f"blockwise_matmul: operand {label} must be a BlockQuantized")
        if q.data.dim() != 2:
            raise ValueError(
                f"blockwise_matmul: operand {label} must be 2-D, got {tuple(q.data.shape)}; "
                "flatten the token dims first"
            )
        if q.block not in ((1, TILE_K), (TILE_K, TILE_K)):
            raise ValueError(
                f"blockwise_matmul: operand {label} has block {q.block}, but operands must be "
                f"blocked along their last (reduction) dim: (1, {TILE_K}) or ({TILE_K}, {TILE_K}). "
                f"A ({TILE_K}, 1) operand (WGrad) must be passed as q.t()."
            )
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(
            f"blockwise_matmul: reduction dims differ: a is {tuple(a.data.shape)}, "
            f"b is {tuple(b.data.shape)} (computing a @ b.T; both need K last)"
        )


def blockwise_matmul(
    a: BlockQuantized,
    b: BlockQuantized,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    exact: bool = False,
) -> torch.Tensor:
    """``a @ b.T`` for ``a`` ``[M, K]`` and ``b`` ``[N, K]`` blocked along K (see module docs).

    ``exact=True``: fp32 accumulation per 128-wide K tile with scales applied per tile (the
    TE/DeepGEMM reference); ``exact=False``: dequantize to fp32, one matmul. Result in
    ``out_dtype``.
    """
    _check(a, b)
    m, k = a.data.shape
    n = b.data.shape[0]
    if not exact:
        return (a.dequantize(torch.float32) @ b.dequantize(torch.float32).t()).to(out_dtype)
    sa = _row_scales(a, m)  # [M, Kt]
    sb = _row_scales(b, n)  # [N, Kt]
    qa, qb = a.data.float(), b.data.float()
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    for t, k0 in enumerate(range(0, k, TILE_K)):
        partial = qa[:, k0 : k0 + TILE_K] @ qb[:, k0 : k0 + TILE_K].t()
        acc += partial * (sa[:, t, None] * sb[None, :, t])
    return acc.to(out_dtype)
