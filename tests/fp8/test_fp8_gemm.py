"""Blockwise GEMM: exact (per-tile fp32) and fast paths vs float64 on the same quantized operands."""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.fp8 import quantize_blockwise
from nemo_jetrl.fp8.gemm import blockwise_matmul

U32 = 2.0**-24  # fp32 unit roundoff


def _operands(m, n, k, a_block, b_block, seed=0, fmt_b="e4m3"):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)).to(torch.bfloat16)
    b = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    return quantize_blockwise(a, a_block), quantize_blockwise(b, b_block, fmt=fmt_b)


def _ref64(qa, qb):
    da, db = qa.dequantize(torch.float64), qb.dequantize(torch.float64)
    return da @ db.t(), da.abs() @ db.abs().t()


CASES = [  # (M, N, K, a block, b block, purpose)
    (64, 256, 384, (1, 128), (128, 128), "fprop"),
    (50, 200, 300, (1, 128), (128, 128), "ragged"),
    (96, 128, 256, (1, 128), (1, 128), "wgrad-shaped"),
]


@pytest.mark.parametrize(("m", "n", "k", "ab", "bb", "why"), CASES)
@pytest.mark.parametrize("exact", [True, False])
def test_vs_float64_bound(m, n, k, ab, bb, why, exact):
    qa, qb = _operands(m, n, k, ab, bb)
    ref, absref = _ref64(qa, qb)
    out = blockwise_matmul(qa, qb, out_dtype=torch.float32, exact=exact).double()
    bound = k * U32 * absref + 1e-30
    assert bool(((out - ref).abs() <= bound).all()), why
    # bf16 output adds one bf16 rounding (2**-9 relative) on top
    out16 = blockwise_matmul(qa, qb, out_dtype=torch.bfloat16, exact=exact).double()
    assert bool(((out16 - ref).abs() <= bound + 2.0**-8 * ref.abs()).all())


def test_exact_and_fast_differ_within_bound_and_not_identically():
    qa, qb = _operands(128, 256, 1024, (1, 128), (128, 128), seed=3)
    _, absref = _ref64(qa, qb)
    e = blockwise_matmul(qa, qb, out_dtype=torch.float32, exact=True).double()
    f = blockwise_matmul(qa, qb, out_dtype=torch.float32, exact=False).double()
    assert bool(((e - f).abs() <= 2 * 1024 * U32 * absref).all())
    assert not torch.equal(e, f)  # two summation orders: the bound is not vacuous


def test_dgrad_with_transposed_weight_blocks():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 384, generator=g).to(torch.bfloat16)
    dy = torch.randn(32, 256, generator=g).to(torch.bfloat16)
    qw, qdy = quantize_blockwise(w, (128, 128)), quantize_blockwise(dy, (1, 128), fmt="e5m2")
    dx = blockwise_matmul(qdy, qw.t(), out_dtype=torch.float32, exact=True).double()
    ref = qdy.dequantize(torch.float64) @ qw.dequantize(torch.float64)
    absref = qdy.dequantize(torch.float64).abs() @ qw.dequantize(torch.float64).abs()
    assert dx.shape == (32, 384)
    assert bool(((dx - ref).abs() <= 256 * U32 * absref).all())


def test_wgrad_operands_blocked_along_tokens():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, 256, generator=g).to(torch.bfloat16)  # 200 tokens: ragged reduction
    dy = torch.randn(200, 128, generator=g).to(torch.bfloat16)
    qx, qdy = quantize_blockwise(x, (128, 1)), quantize_blockwise(dy, (128, 1))
    with pytest.raises(ValueError, match=r"q\.t\(\)"):
        blockwise_matmul(qdy, qx)
    dw = blockwise_matmul(qdy.t(), qx.t(), out_dtype=torch.float32, exact=True).double()
    ref = qdy.dequantize(torch.float64).t() @ qx.dequantize(torch.float64)
    absref = qdy.dequantize(torch.float64).abs().t() @ qx.dequantize(torch.float64).abs()
    assert dw.shape == (128, 256)
    assert bool(((dw - ref).abs() <= 200 * U32 * absref).all())


def test_shape_mismatch_is_a_clear_error():
    qa, _ = _operands(4, 128, 256, (1, 128), (128, 128))
    qc = quantize_blockwise(torch.ones(128, 128), (128, 128))
    with pytest.raises(ValueError, match="reduction dims differ"):
        blockwise_matmul(qa, qc)
