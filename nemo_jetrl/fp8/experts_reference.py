"""Pure-torch reference of the grouped expert linear's operations: one expert at a time.

Each function loops over the experts (host offsets) and applies to expert e's rows exactly what
the dense layer (`linear.Fp8BlockLinearFunction` on CPU) applies to a whole input: the reference
quantizer `quantize.quantize_reference` and the reference GEMM `gemm.blockwise_matmul`. Nothing
here is meant to be fast; it is what `triton_grouped` (the fast path, which never calls this
module) is tested against bit for bit, and what runs by default on CPU. Names in errors are
``{name}.expert{e}.{what}``. See `experts` for the math.
"""

from __future__ import annotations

import torch

from nemo_jetrl.fp8.formats import Fp8Format
from nemo_jetrl.fp8.gemm import blockwise_matmul
from nemo_jetrl.fp8.grouped_tensors import (
    GroupedQuantizedWeights,
    GroupedTokenBlocks,
    token_block_capacity,
    token_block_offsets,
    token_capacity,
    token_offsets,
)
from nemo_jetrl.fp8.quantize import BlockQuantized, quantize_reference
from nemo_jetrl.fp8.silu_mul import silu_mul_quantize_reference
from nemo_jetrl.fp8.spec import ACTIVATION_BLOCK, WEIGHT_BLOCK, WGRAD_BLOCK


def _host(offsets: torch.Tensor) -> list[int]:
    return [int(v) for v in offsets.tolist()]


def quantize_rows(
    x: torch.Tensor,
    offsets: torch.Tensor,
    *,
    fmt: Fp8Format,
    pow2_scales: bool,
    eps: float,
    name: str,
    what: str,
    check_finite: bool = True,
) -> BlockQuantized:
    """``x [M, K]`` quantized 1x128, expert by expert (each row is its own block)."""
    off = _host(offsets)
    kw = {"fmt": fmt, "pow2_scales": pow2_scales, "eps": eps, "check_finite": check_finite}
    parts = [
        quantize_reference(x[off[e] : off[e + 1]], ACTIVATION_BLOCK, name=f"{name}.expert{e}.{what}", **kw)
        for e in range(len(off) - 1)
    ]  # fmt: skip
    data, scale = torch.cat([p.data for p in parts]), torch.cat([p.scale_inv for p in parts])
    return BlockQuantized(data, scale, ACTIVATION_BLOCK, fmt.name, pow2_scales)


def quantize_input(
    x: torch.Tensor, *, fmt: Fp8Format, pow2_scales: bool, eps: float, name: str,
    check_finite: bool = True,
) -> BlockQuantized:  # fmt: skip
    """The unsorted ``[T, H]`` input quantized 1x128 once (the serving MoE layer)."""
    return quantize_reference(
        x, ACTIVATION_BLOCK, fmt=fmt, pow2_scales=pow2_scales, eps=eps, name=f"{name}.input",
        check_finite=check_finite,
    )  # fmt: skip


def silu_mul_quantize(
    gate_up: torch.Tensor, offsets: torch.Tensor, *, fmt: Fp8Format, pow2_scales: bool,
    eps: float, name: str, what: str = "input", check_finite: bool = True,
) -> BlockQuantized:  # fmt: skip
    """`silu_mul` then the 1x128 quantization, expert by expert (errors name the expert)."""
    off = _host(offsets)
    kw = {"fmt": fmt, "pow2_scales": pow2_scales, "eps": eps, "check_finite": check_finite}
    parts = [
        silu_mul_quantize_reference(gate_up[off[e] : off[e + 1]], name=f"{name}.expert{e}.{what}", **kw)
        for e in range(len(off) - 1)
    ]  # fmt: skip
    data = torch.cat([p.data for p in parts])
    scale = torch.cat([p.scale_inv for p in parts])
    return BlockQuantized(data, scale, ACTIVATION_BLOCK, fmt.name, pow2_scales)


def quantize_experts(
    weight: torch.Tensor,
    *,
    fmt: Fp8Format,
    pow2_scales: bool,
    eps: float,
    name: str,
    check_finite: bool = True,
    pair: bool = False,
) -> tuple[GroupedQuantizedWeights, GroupedQuantizedWeights]:
    """``weight [E, N, K]`` quantized 128x128, expert by expert, and its transpose (a view;
    ``pair`` is the fast path's request for a contiguous copy, moot here)."""
    kw = {"fmt": fmt, "pow2_scales": pow2_scales, "eps": eps, "check_finite": check_finite}
    parts = [
        quantize_reference(weight[e], WEIGHT_BLOCK, name=f"{name}.expert{e}.weight", **kw)
        for e in range(weight.shape[0])
    ]
    data, scale = torch.stack([p.data for p in parts]), torch.stack([p.scale_inv for p in parts])
    qw = GroupedQuantizedWeights(data, scale, fmt.name, pow2_scales)
    return qw, qw.t()


def quantize_tokens(
    x: torch.Tensor,
    offsets: torch.Tensor,
    *,
    fmt: Fp8Format,
    pow2_scales: bool,
    eps: float,
    name: str,
    what: str,
    check_finite: bool = True,
) -> GroupedTokenBlocks:
    """``x [M, C]`` quantized 128x1 with each expert's blocks starting at its first token, its
    codes from column ``token_offsets[e]`` (16-aligned; +0 codes up to the next expert's)."""
    off = _host(offsets)
    m, c = x.shape
    n_exp = len(off) - 1
    data = torch.zeros(c, token_capacity(m, n_exp), dtype=fmt.dtype, device=x.device)
    scale = torch.zeros(c, token_block_capacity(m, n_exp), device=x.device)
    toff = token_offsets(offsets)
    p0 = _host(toff)
    b0 = 0
    kw = {"fmt": fmt, "pow2_scales": pow2_scales, "eps": eps, "check_finite": check_finite}
    for e in range(n_exp):
        r0, r1 = off[e], off[e + 1]
        if r1 == r0:
            continue
        q = quantize_reference(x[r0:r1], WGRAD_BLOCK, name=f"{name}.expert{e}.{what}", **kw)
        data[:, p0[e] : p0[e] + r1 - r0] = q.data.t()
        nb = q.scale_inv.shape[0]
        scale[:, b0 : b0 + nb] = q.scale_inv.t()
        b0 += nb
    boff = token_block_offsets(offsets)
    return GroupedTokenBlocks(data, scale, boff, toff, fmt.name, pow2_scales)


def gemm_rows(
    qa: BlockQuantized,
    qb: GroupedQuantizedWeights,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    exact: bool,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[rows_e] = a[rows_e] @ b[e].T`` per expert (FProp: b = W; DGrad: b = W.t()).
    ``rows``: output row m reads A row ``rows[m]`` (the serving layer's once-quantized input)."""
    if rows is not None:  # the gathered codes and scales: the bits of quantizing the gathered x
        qa = BlockQuantized(qa.data[rows], qa.scale_inv[rows], qa.block, qa.fmt, qa.pow2_scales)
    off = _host(offsets)
    out = torch.zeros(qa.data.shape[0], qb.out_features, dtype=out_dtype, device=qa.data.device)
    for e in range(len(off) - 1):
        r0, r1 = off[e], off[e + 1]
        if r1 == r0:
            continue
        a = BlockQuantized(qa.data[r0:r1], qa.scale_inv[r0:r1], qa.block, qa.fmt, qa.pow2_scales)
        out[r0:r1] = blockwise_matmul(a, qb.expert(e), out_dtype=out_dtype, exact=exact)
    return out


def gemm_tokens(
    qa: GroupedTokenBlocks,
    qb: GroupedTokenBlocks,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    exact: bool,
) -> torch.Tensor:
    """``out[e] = a_e @ b_e.T`` over expert e's tokens (WGrad: a = dY.T, b = x.T): ``[E, N, K]``."""
    off = _host(offsets)
    n, k = qa.data.shape[0], qb.data.shape[0]
    out = torch.zeros(len(off) - 1, n, k, dtype=out_dtype, device=qa.data.device)
    for e in range(len(off) - 1):
        if off[e + 1] == off[e]:
            continue  # no token: a sum over nothing
        out[e] = blockwise_matmul(
            qa.expert(e, off), qb.expert(e, off), out_dtype=out_dtype, exact=exact
        )
    return out


def combine(
    y: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``out[t] = sum_j y[pos[t, j]] * weight[pos[t, j]]`` (``pos [T, k]``, -1 absent: +0) in
    slot order: fp32 products, ``k - 1`` fp32 adds, one rounding to ``out_dtype``."""
    prod = y.float() * weight.float()[:, None]
    # An absent slot reads an appended +0 row: no row may be read when this rank holds no route
    # at all (expert parallel: every token went to other ranks' experts, y is [0, H]).
    prod = torch.cat([prod, prod.new_zeros(1, prod.shape[1])])
    rows = torch.where(pos >= 0, pos, y.shape[0])
    acc = prod[rows[:, 0]]
    for j in range(1, pos.shape[1]):
        acc = acc + prod[rows[:, j]]
    return acc.to(out_dtype)
