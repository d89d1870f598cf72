"""The exact GEMM's float64 weight copy (`fp64_operands`): made once per FP8 weight version on
CPU, never stale, same bits and layout as converting on every call (issue 40).

Each "fresh" result comes from a layer or tensor the cache has never seen (new storage), so it
is the float64 conversion of the current FP8 bits.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from nemo_jetrl.fp8 import fp8_bits
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.fp64_operands import (
    clear_fp64_operands,
    fp8_to_fp64,
    fp64_of,
    fp64_operand_stats,
)
from nemo_jetrl.fp8.gemm import blockwise_matmul
from nemo_jetrl.fp8.inference_linear import Fp8InferenceLinear
from nemo_jetrl.fp8.linear import Fp8BlockLinear
from nemo_jetrl.fp8.quantize import quantize_reference

EXACT = Fp8LinearConfig(exact_gemm=True)


def _x(rows=24, k=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g) * 2).to(torch.bfloat16)


def _rollout_layer(seed=0, n=384, k=256):
    torch.manual_seed(seed)
    return Fp8InferenceLinear.from_linear(nn.Linear(k, n), EXACT, name="blk")


def _fresh_out(layer, x):
    """The same layer's current FP8 bits in a new layer (storage the cache never saw)."""
    n, k, dt = layer.out_features, layer.in_features, layer.bias.dtype
    ref = Fp8InferenceLinear(k, n, True, config=EXACT, bias_dtype=dt)
    ref.commit(ref.stage_quantized(layer.weight_fp8.clone(), layer.weight_scale_inv, layer.bias))
    return ref(x)


def _bits(t):
    return fp8_bits(t.contiguous())


@pytest.mark.parametrize("shape", [(256, 512), (192, 320), (77, 200)])
def test_the_copy_has_the_values_and_strides_of_a_fresh_conversion(shape):
    """W, the W.T view DGrad reads, a row slice and a column slice (not dense: contiguous, as
    ``.double()`` makes it): every layout the matmul sees is the one it saw before."""
    q = quantize_reference(torch.randn(*shape), (128, 128)).data
    for t in (q, q.t(), q[5:50], q[:, :100]):
        got, want = fp64_of(t), t.double()
        assert torch.equal(got, want) and got.stride() == want.stride()
    assert fp64_operand_stats()["held"] >= 1


def test_one_copy_per_weight_version_shared_by_w_and_its_transpose():
    layer = Fp8BlockLinear.from_linear(nn.Linear(256, 384), EXACT, name="blk")
    gc.collect()  # layers of earlier tests in this process free their copies now, not below
    before = fp64_operand_stats()
    for seed in (1, 2, 3):
        x = _x(seed=seed).requires_grad_(True)
        layer(x).float().sum().backward()  # FProp reads W, DGrad the W.T view: one copy
    after = fp64_operand_stats()
    assert after["made"] - before["made"] == 1
    assert after["reused"] - before["reused"] == 5  # 3 FProps + 3 DGrads - the first
    assert after["bytes"] - before["bytes"] == 8 * 384 * 256  # 8 bytes per FP8 element
    del layer
    gc.collect()
    assert fp64_operand_stats()["bytes"] == before["bytes"]  # gone with the FP8 weight


REFITS = {
    "load_weight (refit)": lambda layer: layer.load_weight(torch.randn(384, 256), layer.bias),
    "stage + commit": lambda layer: layer.commit(
        layer.stage_quantized(_flip(layer.weight_fp8, 0), layer.weight_scale_inv.flip(0))
    ),
    "in-place write on a uint8 view": lambda layer: _no_grad(
        lambda: layer.weight_fp8.view(torch.uint8)[:128].bitwise_xor_(1)
    ),
    "load_state_dict": lambda layer: layer.load_state_dict(
        {**layer.state_dict(), "weight_fp8": _flip(layer.weight_fp8, 1)}
    ),
}


def _flip(q, dim):
    return q.view(torch.uint8).flip(dim).view(q.dtype)  # FP8 has no flip kernel on CPU


def _no_grad(fn):
    with torch.no_grad():
        fn()


@pytest.mark.parametrize("refit", sorted(REFITS))
def test_a_rollout_weight_written_in_place_gives_the_new_bits(refit):
    layer, x = _rollout_layer(), _x()
    old = layer(x)
    assert torch.equal(_bits(layer(x)), _bits(old))  # second call: the cached copy
    REFITS[refit](layer)
    got = layer(x)
    assert not torch.equal(_bits(got), _bits(old))
    assert torch.equal(_bits(got), _bits(_fresh_out(layer, x)))


def test_a_training_weight_after_an_optimizer_step_gives_the_new_bits():
    layer = Fp8BlockLinear.from_linear(nn.Linear(256, 384), EXACT, name="blk")
    opt = torch.optim.AdamW(layer.parameters(), lr=0.05, fused=True)  # no version bump
    x = _x()
    old = layer(x.requires_grad_(True))
    old.float().sum().backward()
    opt.step()
    got = layer(x)
    assert not torch.equal(_bits(got), _bits(old))
    ref = Fp8BlockLinear.from_linear(nn.Linear(256, 384), EXACT, name="ref", cache_weight=False)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
        ref.bias.copy_(layer.bias)
    assert torch.equal(_bits(got), _bits(ref(x)))


def test_writes_through_data_need_clear_fp64_operands():
    """``t.data`` is a new version counter (the same hole as `weight_cache`): documented, and
    closed by `clear_fp64_operands`."""
    q = quantize_reference(torch.randn(256, 256), (128, 128))
    a = quantize_reference(torch.randn(8, 256), (1, 128))
    stale = blockwise_matmul(a, q, exact=True)
    q.data.data.copy_(q.data.flip(0))
    assert torch.equal(_bits(blockwise_matmul(a, q, exact=True)), _bits(stale))
    assert clear_fp64_operands() >= 1
    want = blockwise_matmul(a, q, exact=True)
    assert not torch.equal(_bits(want), _bits(stale))
    assert torch.equal(_bits(want), _bits(blockwise_matmul(a, _copy(q), exact=True)))


def _copy(q):
    return type(q)(q.data.clone(), q.scale_inv.clone(), q.block, q.fmt, q.pow2_scales)


def test_inference_tensors_and_activations_are_never_cached():
    with torch.inference_mode():
        q = quantize_reference(torch.randn(256, 256), (128, 128))
    a = quantize_reference(torch.randn(8, 256), (1, 128))
    w = quantize_reference(torch.randn(256, 256), (128, 128))
    gc.collect()  # earlier tests' layers free their copies now, not mid-test
    before = fp64_operand_stats()
    out = blockwise_matmul(a, q, exact=True)  # b: an inference tensor (no version counter)
    blockwise_matmul(w, a, exact=True)  # 128x128 a, 1x128 b (activation-like): converted
    blockwise_matmul(a, w, exact=False)  # the fast path converts nothing to float64
    assert fp64_operand_stats() == before
    assert torch.equal(_bits(out), _bits(blockwise_matmul(a, _copy(q), exact=True)))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_code_table_gives_the_casts_bits_for_every_code(dtype):
    """NaN and inf codes included, in a large tensor (torch's vectorised cast) and a view."""
    codes = torch.randint(0, 256, (333, 1000), dtype=torch.uint8)
    codes[0, :256] = torch.arange(256, dtype=torch.uint8)
    t = codes.view(dtype)
    for x in (t, t.t(), t[:, 7:300]):
        got, want = fp8_to_fp64(x), x.double()
        assert torch.equal(got.view(torch.int64), want.view(torch.int64))
        assert got.stride() == want.stride()


def test_a_weight_past_the_byte_budget_converts_per_call(monkeypatch):
    """JETRL_FP64_OPERAND_BYTES bounds what is held (8 bytes per FP8 element): a weight that
    would pass it is converted per call, same values, nothing held; a bad value is named."""
    clear_fp64_operands()
    q = quantize_reference(torch.randn(256, 512), (128, 128)).data
    monkeypatch.setenv("JETRL_FP64_OPERAND_BYTES", str(8 * q.numel() - 1))
    assert torch.equal(fp64_of(q), q.double())
    assert fp64_operand_stats()["held"] == 0
    monkeypatch.setenv("JETRL_FP64_OPERAND_BYTES", str(8 * q.numel()))
    assert torch.equal(fp64_of(q), q.double())
    assert fp64_operand_stats()["bytes"] == 8 * q.numel()
    monkeypatch.setenv("JETRL_FP64_OPERAND_BYTES", "lots")
    clear_fp64_operands()
    with pytest.raises(ValueError, match="JETRL_FP64_OPERAND_BYTES='lots'"):
        fp64_of(q)
