"""Layout converters: TE / vLLM / DeepGEMM shapes, strides, and lossless round trips."""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise
from nemo_jetrl.fp8.layouts import (
    deepgemm_sf_fp32,
    deepgemm_sf_ue8m0,
    deepgemm_sf_ue8m0_decode,
    from_te,
    from_vllm_weight,
    to_te,
    to_vllm_weight,
)


def _x(m, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)).to(torch.bfloat16)


def _same(a, b):
    assert a.block == b.block and a.fmt == b.fmt
    assert torch.equal(fp8_bits(a.data), fp8_bits(b.data))
    assert torch.equal(a.scale_inv, b.scale_inv)


@pytest.mark.parametrize(("m", "k"), [(256, 384), (50, 200), (130, 1000)])
def test_te_1d_layout_shapes_and_round_trip(m, k):
    x = _x(m, k)
    row, col = quantize_blockwise(x, (1, 128)), quantize_blockwise(x, (128, 1))
    t = to_te(row, col)
    pad4 = lambda n: -(-n // 4) * 4  # noqa: E731
    assert not t.is_2D_scaled
    assert t.rowwise_data.shape == (m, k) and t.rowwise_data.dtype == torch.uint8
    assert t.rowwise_scale_inv.shape == (-(-k // 128), pad4(m))
    assert t.columnwise_data.shape == (k, m)
    assert t.columnwise_scale_inv.shape == (-(-m // 128), pad4(k))
    assert torch.equal(t.columnwise_data, fp8_bits(col.data).t())
    assert torch.equal(t.rowwise_scale_inv[:, :m], row.scale_inv.t())
    r2, c2 = from_te(t)
    _same(r2, row)
    _same(c2, col)


@pytest.mark.parametrize(("m", "k"), [(768, 1024), (200, 320)])
def test_te_2d_layout_shapes_and_round_trip(m, k):
    q = quantize_blockwise(_x(m, k), (128, 128), pow2_scales=False)
    t = to_te(q, q)
    mb, kb = -(-m // 128), -(-k // 128)
    assert t.is_2D_scaled
    assert t.rowwise_scale_inv.shape == (mb, -(-kb // 4) * 4)
    assert t.columnwise_scale_inv.shape == (kb, -(-mb // 4) * 4)
    assert t.columnwise_data.shape == (k, m)
    r2, c2 = from_te(t, pow2_scales=False)
    _same(r2, q)
    _same(c2, q)
    with pytest.raises(ValueError, match="columnwise"):
        to_te(q, quantize_blockwise(_x(m, k), (128, 1)))


def test_vllm_weight_round_trip_and_checks():
    q = quantize_blockwise(_x(200, 320), (128, 128))
    params = to_vllm_weight(q)
    assert params["weight"].dtype == torch.float8_e4m3fn and params["weight"].shape == (200, 320)
    assert params["weight_scale_inv"].shape == (2, 3)
    _same(from_vllm_weight(**params, pow2_scales=True), q)
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        from_vllm_weight(params["weight"], torch.ones(3, 3), pow2_scales=True)
    with pytest.raises(ValueError, match="128x128"):
        to_vllm_weight(quantize_blockwise(_x(4, 128), (1, 128)))


def test_deepgemm_fp32_sf_is_mn_major_tma_aligned():
    q = quantize_blockwise(_x(50, 384), (1, 128), pow2_scales=False)
    sf = deepgemm_sf_fp32(q)
    assert sf.shape == (50, 3) and sf.stride() == (1, 52)
    assert torch.equal(sf, q.scale_inv)
    w = quantize_blockwise(_x(256, 384), (128, 128), pow2_scales=False)
    assert torch.equal(deepgemm_sf_fp32(w), w.scale_inv) and deepgemm_sf_fp32(w).is_contiguous()


@pytest.mark.parametrize(("block", "m", "k"), [((1, 128), 50, 640), ((128, 128), 300, 384)])
def test_deepgemm_ue8m0_packing_round_trip(block, m, k):
    q = quantize_blockwise(_x(m, k), block, pow2_scales=True)
    packed = deepgemm_sf_ue8m0(q)
    kb = -(-k // 128)
    aligned_m = -(-m // 4) * 4
    assert packed.dtype == torch.int32
    assert packed.shape == (m, -(-kb // 4)) and packed.stride() == (1, aligned_m)
    per_row = q.scale_inv if block == (1, 128) else q.scale_inv.repeat_interleave(128, 0)[:m]
    assert torch.equal(deepgemm_sf_ue8m0_decode(packed, kb), per_row)
    # byte j of word 0 is K block j: check one entry by hand
    e = int(packed[0, 0]) & 0xFF
    assert 2.0 ** (e - 127) == float(per_row[0, 0])


def test_deepgemm_ue8m0_refuses_fp32_scales():
    q = quantize_blockwise(_x(8, 256), (1, 128), pow2_scales=False)
    with pytest.raises(ValueError, match="pow2_scales=True"):
        deepgemm_sf_ue8m0(q)
