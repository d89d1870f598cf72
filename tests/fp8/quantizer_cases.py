"""What the quantizer test modules share (test_quantizer_rowcol.py,
test_quantizer_flag_and_cast.py): their scale modes, the adversarial input, every finite bf16 bit
pattern, and the bit-for-bit comparison of two quantized tensors.
"""

from __future__ import annotations

import torch

from nemo_jetrl.fp8 import fp8_bits

MODES = [(f, p) for f in ("e4m3", "e5m2") for p in (True, False)]


def _input(m, k, dtype, seed):
    """Per-group magnitudes over 60 decades, outliers, zeros, a zero column block, tiny amax."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    x *= 10.0 ** (-30 + 60 * torch.rand(m, 1, generator=g, dtype=torch.float64))
    x *= 10.0 ** (-3 + 6 * torch.rand(1, k, generator=g, dtype=torch.float64))
    x[torch.rand(m, k, generator=g) < 0.01] *= 100.0
    x[torch.rand(m, k, generator=g) < 0.05] = 0.0
    x[:, : min(k, 3)] = 0.0  # all-zero 128x1 columns
    if m > 20:
        x[10:20] = x[10:20].sign() * 1e-37  # scale overflows to finfo.max: subnormal scale_inv
    return x.to(dtype)


def _bits(q):
    return fp8_bits(q.data.cpu().contiguous()), q.scale_inv.cpu().contiguous().view(torch.int32)


def assert_same(got, want, label):
    assert got.data.shape == want.data.shape and got.block == want.block, label
    assert got.fmt == want.fmt and got.scale_inv.shape == want.scale_inv.shape, label
    (gd, gs), (wd, ws) = _bits(got), _bits(want)
    assert torch.equal(gd, wd), f"{label}: {int((gd != wd).sum())} FP8 bytes differ"
    assert torch.equal(gs, ws), f"{label}: {int((gs != ws).sum())} scale_inv values differ"


def _all_finite_bf16(layout):
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[torch.isfinite(x)]  # 65280 patterns (+-inf and NaNs removed)
    if layout == "shuffled":  # blocks mixing every magnitude: subnormal codes, zero codes
        x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    else:  # sorted: blocks of neighbouring patterns (every amax exponent, ties inside)
        x = x.sort().values
    return x.reshape(-1, 128)  # [510, 128]
