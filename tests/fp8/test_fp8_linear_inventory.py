"""Launch/allocation inventory of one `Fp8BlockLinear` training step on its CUDA path (issue 35).

The layer runs on CPU tensors exactly what it runs on a GPU (as in test_fp8_linear_sync_free:
deferred non-finite flags, the Triton quantizers under TRITON_INTERPRET=1, GEMMs through the
planned backend), inside `fp8_inventory.Inventory`. The GEMM kernel itself is a labelled fake
(`fake_gemm_runner`: one launch; cuBLASLt/DeepGEMM cannot run here), so what is counted is the
layer's own work around its three GEMMs: quantizer launches, flag kernels, casts, fills, copies.

Measured step: the second micro-batch (same weight, gradients set to None so autograd's own
accumulation adds are not counted), bf16 x/W (and bias), 256 tokens, K=256, N=384.

Before issue 35 (tree 696f711, this test run there) the step made 29 launches (23 without a
bias) and 11 allocations: 5 quantizer launches (x 1x128, W and W.T in one pass, x 128x1, dy 1x128, dy 128x1:
the weight re-quantized on every micro-batch), 15 flag kernels (isnan + any + logical_or per
quantization), 3 GEMMs, 4 casts (bias to fp32, the fp32 output to bf16, dy to fp32 for dbias,
dbias to bf16), an add, a sum. Now 9 launches and 8 allocations with a bias, 5 without: x and dy
each quantized 1x128 + 128x1 in one fused launch that also writes the device's non-finite flag
(no isnan/any kernels), the weight from the cache, 3 GEMMs; with a bias, FProp's fp32 output
gets the bias added in place and one cast, dbias one fp32 sum and one cast. With the default
``JETRL_FP8_ROWCOL=two_pass`` (two passes measured faster on GPUs, `linear_plan.ROWCOL_DEFAULT`)
x and dy take two launches each (1x128, then 128x1 transposed): 11 launches, 7 without a bias.
"""

from __future__ import annotations

import pytest
import torch
from fp8_inventory import Inventory, fake_gemm_runner, record_triton
from torch import nn

from nemo_jetrl.fp8 import dispatch, finite_flags, gemm_backends, linear, linear_plan
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.linear import Fp8BlockLinear

pytestmark = [
    pytest.mark.triton,
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

# Bounds of one step (issue 35's GPU target: <= 12 kernel launches per step), by rowcol mode and
# bias: two passes launch one more quantizer kernel for each of x and dy.
MAX_LAUNCHES = {("fused", True): 9, ("fused", False): 5, ("two_pass", True): 11,
                ("two_pass", False): 7}  # fmt: skip
QUANTIZER_LAUNCHES = {"fused": 2, "two_pass": 4}  # x and dy, the weight from the cache
MAX_ALLOCS = 8  # x and dy: row and column data and scales (GEMM outputs are the fake's)


@pytest.fixture
def inventory(monkeypatch):
    from nemo_jetrl.fp8.triton_kernels import interpreting

    if not interpreting():
        pytest.skip("emulates the CUDA path on CPU tensors in Triton's interpreter")
    inv = Inventory()
    record_triton(monkeypatch, inv)
    monkeypatch.setattr(finite_flags, "sync_free", lambda t: True)
    monkeypatch.setattr(linear, "_on_gpu", lambda t: True)
    monkeypatch.setattr(dispatch, "_fast", lambda x, backend: True)  # Triton quantizers
    monkeypatch.setenv(gemm_backends.ENV_GEMM_BACKEND, "triton")
    monkeypatch.setitem(gemm_backends.RUNNERS, "triton", fake_gemm_runner(inv, "triton"))
    gemm_backends._plan_cached.cache_clear()
    yield inv
    gemm_backends._plan_cached.cache_clear()
    finite_flags._FLAGS.clear()


def _micro_batch(layer, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 256, generator=g).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(256, 384, generator=g).to(torch.bfloat16)
    return x, dy


@pytest.mark.parametrize("rowcol", ["fused", "two_pass"])
@pytest.mark.parametrize("bias", [True, False])
def test_second_micro_batch_stays_within_the_launch_budget(inventory, monkeypatch, bias, rowcol):
    monkeypatch.setenv(linear_plan.ENV_ROWCOL, rowcol)
    torch.manual_seed(0)
    base = nn.Linear(256, 384, bias=bias, dtype=torch.bfloat16)
    layer = Fp8BlockLinear.from_linear(base, Fp8LinearConfig(), name="blk")
    x, dy = _micro_batch(layer, 1)
    layer(x).backward(dy)  # first micro-batch: plans, quantizes the weight
    layer.zero_grad(set_to_none=True)
    x, dy = _micro_batch(layer, 2)
    inventory.ops.clear()
    with inventory:
        layer(x).backward(dy)
    launches, allocs = inventory.count("launch"), inventory.count("alloc")
    quantizer = [op for op in inventory.ops if op.startswith("triton:")]
    print(f"bias={bias}: launches {launches}, allocations {allocs}: {inventory.table()}")
    assert inventory.ops.count("gemm:triton") == 3, inventory.table()
    assert len(quantizer) == QUANTIZER_LAUNCHES[rowcol], f"x and dy, no weight: {inventory.table()}"
    assert launches <= MAX_LAUNCHES[rowcol, bias], inventory.table()
    assert allocs <= MAX_ALLOCS, inventory.table()
    no = ("zeros", "constant_pad_nd", "clone", "copy_", "fill_", "zero_", "isnan", "any")
    assert not set(no) & set(inventory.ops), inventory.table()
