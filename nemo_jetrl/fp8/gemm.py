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

``exact=True`` evaluates that in Transformer Engine's order (TE's cuBLAS-equivalent reference GEMM,
``CuBLASRefBlockwiseGemm``): per tile, ``p`` = the tile's dot product in fp32, then

    1D x any (a is 1x128):  acc = fma(p * sa, sb, acc)
    2D x 1D:                acc = fma(p * sb, sa, acc)
    2D x 2D:                acc = fma(p, sa * sb, acc)

with one fp32 rounding for the product and one for the fused multiply-add (`fma_fp32`). ``p``
is the exact dot rounded once to fp32 (computed in float64, where it is exact for E4M3 operands:
every product is a multiple of 2**-18 and the sum stays below 2**25, 43 bits in all), so it does
not depend on summation order or CPU. With power-of-two scales every scaling is exact and any
order gives the same bits; with FP32 scales the order matters (``acc += p * (sa * sb)``, the
order this module used before, agrees with TE's on only about half of the outputs).
``exact=False`` dequantizes both operands to fp32 and does one fp32 matmul: faster on CPU,
different rounding. Both are within ``K * 2**-24 * (|A| @ |B|.T)`` of the float64 product of the
dequantized operands (the usual recursive-summation bound with unit roundoff 2**-24), so they
differ by at most twice that. GEMM output bits are not part of the on-policy promise (only the
quantized *inputs* are).
"""

from __future__ import annotations

import math

import torch

from nemo_jetrl.fp8.fp64_operands import fp8_to_fp64, fp64_of
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

    ``exact=True``: fp32 accumulation per 128-wide K tile with scales applied per tile in
    Transformer Engine's rounding order (see the module docstring); ``exact=False``: dequantize to fp32, one matmul. Result in
    ``out_dtype``.
    """
    _check(a, b)
    m, k = a.data.shape
    n = b.data.shape[0]
    if not exact:
        return (a.dequantize(torch.float32) @ b.dequantize(torch.float32).t()).to(out_dtype)
    sa = _row_scales(a, m)  # [M, Kt]
    sb = _row_scales(b, n)  # [N, Kt]
    # b blocked 128x128 is the weight (W, or W.T in DGrad): its float64 copy is made once per
    # weight version on CPU (`fp64_operands`); a is an activation, new on every call.
    qa = fp8_to_fp64(a.data)
    qb = fp64_of(b.data) if b.block[0] == TILE_K else fp8_to_fp64(b.data)
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    plain = _scaling_is_exact(sa, sb)
    s_ab = torch.empty(m, n, dtype=torch.float32, device=a.data.device) if plain else None
    for t, k0 in enumerate(range(0, k, TILE_K)):
        p = (qa[:, k0 : k0 + TILE_K] @ qb[:, k0 : k0 + TILE_K].t()).float()
        if plain:  # p * (s_a * s_b) is exact: one rounding in the add, as in the fma
            torch.mul(sa[:, t, None], sb[None, :, t], out=s_ab)  # in place: no fresh [M, N]
            acc = p.mul_(s_ab).add_(acc)
            continue
        s_a, s_b = sa[:, t, None].expand(m, n), sb[None, :, t].expand(m, n)
        if a.block[0] == 1:
            acc = fma_fp32(p * s_a, s_b, acc)
        elif b.block[0] == 1:
            acc = fma_fp32(p * s_b, s_a, acc)
        else:
            acc = fma_fp32(p, s_a * s_b, acc)
    return acc.to(out_dtype)


def _scaling_is_exact(sa: torch.Tensor, sb: torch.Tensor) -> bool:
    """True when every scale is a power of two and no scaled tile sum can leave fp32's normal
    range: then ``p * sa * sb`` is exact in any order and a plain add rounds once, like the fma.
    Tile sums are multiples of 2**-32 (E5M2 x E5M2; 2**-18 for E4M3) below 2**40."""
    if sa.numel() == 0 or sb.numel() == 0:
        return False
    for s in (sa, sb):
        if not bool(((s.view(torch.int32) & 0x7FFFFF) == 0).all()) or not bool((s > 0).all()):
            return False
    lo = math.log2(sa.min().item()) + math.log2(sb.min().item())
    hi = math.log2(sa.max().item()) + math.log2(sb.max().item())
    return lo - 32 >= -126 and hi + 40 < 127


def fma_fp32(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``x * y + z`` for fp32 tensors with a single rounding, as a fused multiply-add does.

    torch has no fma op (``addcmul`` may round twice). ``x * y`` is exact in float64 (24 + 24
    significant bits); the sum with ``z`` is made round-to-odd in float64 (TwoSum gives its exact
    error; an inexact result with an even last bit moves one float64 step towards the exact
    value), and rounding a round-to-odd value with 53 >= 24 + 2 bits to fp32 gives the correctly
    rounded fp32 of the exact value (Boldo & Melquiond). Plain float64 ``x * y + z`` then
    ``.float()`` would round twice and is wrong when the float64 sum lands on an fp32 tie.
    """
    prod = x.double() * y.double()
    zd = z.double()
    s = prod + zd
    bp = s - prod
    err = (prod - (s - bp)) + (zd - bp)  # s + err == prod + z exactly
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(s.dtype)
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()
