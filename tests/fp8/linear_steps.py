"""What the FP8 linear test modules share: one fwd+bwd step on seeded bf16 data, quantizing an
operand the way a config's layer does (the float64 references rebuild the layer's operands), and
the `cuda_path` fixture (import it into a test module to use it)."""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.fp8 import dispatch, finite_flags, gemm_backends, quantize_blockwise
from nemo_jetrl.fp8.config import Fp8LinearConfig


def run_step(layer: torch.nn.Module, shape: tuple[int, ...], seed: int = 1):  # type: ignore[no-untyped-def]
    """``x`` (bf16, needs grad), ``y = layer(x)`` and ``dy`` after ``y.backward(dy)``."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    y = layer(x)
    dy = torch.randn(y.shape, generator=g).to(torch.bfloat16)
    y.backward(dy)
    return x, y, dy


def quantize_as(t: torch.Tensor, block: tuple[int, int], cfg: Fp8LinearConfig, fmt: str):  # type: ignore[no-untyped-def]
    """``t`` quantized in ``block`` with ``cfg``'s scale mode and eps, in format ``fmt``."""
    return quantize_blockwise(t, block, fmt=fmt, pow2_scales=cfg.pow2_scales, eps=cfg.eps)


@pytest.fixture
def cuda_path(monkeypatch):  # type: ignore[no-untyped-def]
    """The layer's CUDA path on CPU tensors: Triton quantizers (interpreter), device-side finite
    flags, GEMMs through the dispatch. (test_fp8_linear_sync_free overrides it: it also records
    every GEMM's operands.)"""
    from nemo_jetrl.fp8 import linear
    from nemo_jetrl.fp8.triton_kernels import interpreting

    if not interpreting():
        pytest.skip("emulates the CUDA path on CPU tensors in Triton's interpreter")
    monkeypatch.setattr(finite_flags, "sync_free", lambda t: True)
    monkeypatch.setattr(linear, "_on_gpu", lambda t: True)
    monkeypatch.setattr(dispatch, "_fast", lambda x, backend: True)
    gemm_backends._plan_cached.cache_clear()
    yield
    gemm_backends._plan_cached.cache_clear()
    finite_flags._FLAGS.clear()
