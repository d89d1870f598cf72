"""`Fp8BlockLinear`'s per-layer plan: environment knobs read once, at plan time (issue 35).

The layer runs its CUDA path on CPU tensors (as in test_fp8_linear_sync_free: Triton quantizers
under TRITON_INTERPRET=1, GEMMs through the planned backend, deferred flags).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import linear_steps
import pytest
import torch
from torch import nn

from nemo_jetrl.fp8 import dispatch, gemm_backends, gemm_layouts, linear
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.linear import Fp8BlockLinear

pytestmark = [
    pytest.mark.triton,
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]
# The modules of the training linear's per-call path this test holds to "no environment read".
OWN = ("linear", "linear_plan", "weight_cache", "dispatch", "gemm_backends", "gemm_layouts")

cuda_path = linear_steps.cuda_path  # the shared fixture (tests/fp8/linear_steps.py)


class _ReadRecorder(dict):
    """``os.environ`` stand-in counting reads per calling module (values copied from it)."""

    def __init__(self, env, reads: Counter) -> None:
        super().__init__(env)
        self.reads = reads

    def _note(self) -> None:
        self.reads[sys._getframe(2).f_globals.get("__name__", "?")] += 1

    def get(self, key, default=None):  # type: ignore[override]
        self._note()
        return super().get(key, default)

    def __getitem__(self, key):
        self._note()
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self._note()
        return super().__contains__(key)


def _step(layer, seed=1, tokens=130):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 256, generator=g).to(torch.bfloat16).requires_grad_(True)
    y = layer(x)
    y.backward(torch.randn(y.shape, generator=g).to(torch.bfloat16))
    _step.last_dx = x.grad
    return y


def _layer(config=None):
    torch.manual_seed(0)
    base = nn.Linear(256, 384, dtype=torch.bfloat16)
    return Fp8BlockLinear.from_linear(base, config or Fp8LinearConfig(), name="blk")


def test_a_planned_step_reads_no_environment_variable(cuda_path, monkeypatch):
    monkeypatch.setenv(gemm_backends.ENV_GEMM_BACKEND, "reference")
    layer = _layer()
    _step(layer)  # plans
    reads: Counter = Counter()
    monkeypatch.setattr(os, "environ", _ReadRecorder(os.environ, reads))
    _step(layer, seed=2)
    own = {m: n for m, n in reads.items() if m.rsplit(".", 1)[-1] in OWN}
    assert own == {}, f"per-call environment reads: {dict(reads)}"
    layer.replan()
    _step(layer, seed=3)
    assert reads["nemo_jetrl.fp8.linear_plan"] >= 1  # a new plan does read them


def test_gemm_and_quantizer_knobs_are_read_at_plan_time(cuda_path, monkeypatch):
    monkeypatch.setenv(gemm_backends.ENV_GEMM_BACKEND, "reference")
    monkeypatch.setenv(dispatch.ENV_QUANT_BACKEND, "torch")
    layer = _layer(Fp8LinearConfig.te_blockwise_hybrid())
    _step(layer)
    plan = layer.fp8_state.plan
    assert (plan.gpu, plan.quant, plan.fprop, plan.dgrad, plan.wgrad) == (
        True, "torch", "reference", "reference", "reference",
    )  # fmt: skip
    assert (plan.x_layout, plan.dy_layout, plan.wgrad_layout) == ("compact",) * 3
    monkeypatch.setenv(gemm_backends.ENV_GEMM_BACKEND, "triton")
    _step(layer)
    assert layer.fp8_state.plan is plan  # held: the knob changed after planning
    layer.replan()
    _step(layer)
    assert layer.fp8_state.plan.fprop == "triton" and layer.fp8_state.plan.wgrad == "triton"
    monkeypatch.setenv(gemm_backends.ENV_GEMM_BACKEND, "cutlass")
    layer.replan()
    with pytest.raises(ValueError, match=gemm_backends.ENV_GEMM_BACKEND):
        _step(layer)


def test_a_new_dtype_gets_a_new_plan(cuda_path, monkeypatch):
    monkeypatch.setenv(gemm_backends.ENV_GEMM_BACKEND, "reference")
    layer = _layer()
    _step(layer)
    first = layer.fp8_state.plan
    x = torch.randn(4, 256, dtype=torch.float32)
    with torch.no_grad():
        layer(x)
    assert layer.fp8_state.plan is not first and layer.fp8_state.plan.key[1] == torch.float32


def test_scaled_mm_plans_ask_the_quantizer_for_its_scale_layout():
    """cuBLASLt reads MN-major 1x128 scales: a scaled_mm plan has the Triton quantizer write them
    (no per-call transpose copy in the runner); other backends, and the torch quantizer, keep
    the compact layout."""
    from nemo_jetrl.fp8 import linear_plan

    key = (torch.device("cuda", 0), torch.bfloat16, torch.bfloat16, None, None)
    real = linear_plan.plan_gemm

    def fake_plan(device, *, out_dtype, pow2_scales, kind, fmts):  # a GPU's decisions
        return gemm_backends.GemmPlan("scaled_mm" if fmts == ("e4m3", "e4m3") else "triton", "")

    try:
        linear_plan.plan_gemm = fake_plan
        cfg = Fp8LinearConfig()
        p = linear_plan.make_plan(key, cfg, gpu=True, quant="triton", cache_weight=True)
        assert (p.x_layout, p.dy_layout, p.wgrad_layout) == ("mn_major",) * 3
        p = linear_plan.make_plan(key, cfg, gpu=True, quant="torch", cache_weight=True)
        assert (p.x_layout, p.dy_layout, p.wgrad_layout) == ("compact",) * 3
        hybrid = Fp8LinearConfig.te_blockwise_hybrid()  # E5M2 dy: DGrad/WGrad on Triton
        p = linear_plan.make_plan(key, hybrid, gpu=True, quant="triton", cache_weight=True)
        assert (p.x_layout, p.dy_layout, p.wgrad_layout) == ("mn_major", "compact", "compact")
    finally:
        linear_plan.plan_gemm = real


def test_mn_major_scales_give_the_same_step_bits(cuda_path, monkeypatch):
    """The layer's step with the quantizer writing MN-major scales (a scaled_mm plan's layout,
    GEMMs on the reference here) equals the compact-layout step bit for bit."""
    from nemo_jetrl.fp8 import linear_plan

    monkeypatch.setenv(gemm_backends.ENV_GEMM_BACKEND, "reference")
    ref = _layer()
    want = [_step(ref).detach(), _step.last_dx, ref.weight.grad, ref.bias.grad]
    monkeypatch.setattr(linear_plan, "MN_MAJOR_GEMMS", frozenset({"reference"}))
    monkeypatch.setattr(linear, "quant_backend", lambda x, backend=None: "triton")
    layer = _layer()
    got = [_step(layer).detach(), _step.last_dx, layer.weight.grad, layer.bias.grad]
    assert layer.fp8_state.plan.x_layout == "mn_major"
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_scaled_mm_plan_hands_cublaslt_its_layouts_without_per_call_copies(
    cuda_path, monkeypatch
):
    """With scaled_mm planned (faked: the runner checks the layouts, then computes on the
    reference), the cached weight's scales are cuBLASLt's padded ``scale_b`` for FProp and
    DGrad, and the quantizer's activation scales are already MN-major: `_scaled_mm` would copy
    nothing. Bits equal the reference plan's."""
    from nemo_jetrl.fp8 import linear_plan
    from nemo_jetrl.fp8.gemm import blockwise_matmul

    monkeypatch.setenv(gemm_backends.ENV_GEMM_BACKEND, "reference")
    ref = _layer()
    want = [_step(ref, tokens=256).detach(), _step.last_dx, ref.weight.grad]
    seen = []

    def fake_scaled_mm(a, b, out_dtype):  # labelled fake: cuBLASLt cannot run here
        if b.block == (128, 128):
            seen.append(("scale_b stored", gemm_layouts.padded_storage(b.scale_inv) is not None))
        else:
            seen.append(("b mn_major", gemm_layouts.mn_major(b.scale_inv) is b.scale_inv))
        seen.append(("a mn_major", gemm_layouts.mn_major(a.scale_inv) is a.scale_inv))
        return blockwise_matmul(a, b, out_dtype=out_dtype)

    def fake_plan(device, *, out_dtype, pow2_scales, kind, fmts):
        return gemm_backends.GemmPlan("scaled_mm", "faked for the test")

    monkeypatch.setattr(linear_plan, "plan_gemm", fake_plan)
    monkeypatch.setattr(linear, "quant_backend", lambda x, backend=None: "triton")
    monkeypatch.setitem(gemm_backends.RUNNERS, "scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(
        gemm_backends, "device_caps", lambda d: gemm_backends.DeviceCaps(cuda=False)
    )
    layer = _layer()
    for _ in range(2):  # the second step on the cached weight
        layer.zero_grad(set_to_none=True)
        seen.clear()
        y = _step(layer, seed=1, tokens=256)  # M % 4 == 0: cuBLASLt's shape
    assert len(seen) == 6 and all(ok for _, ok in seen), seen
    got = [y.detach(), _step.last_dx, layer.weight.grad]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("layout", ["compact", "mn_major"])
def test_two_pass_rowcol_gives_the_fused_kernels_step_bits(cuda_path, monkeypatch, layout):
    """``JETRL_FP8_ROWCOL=two_pass`` (the 1x128 then the transposed 128x1 Triton kernel) gives
    the fused kernel's (``fused``) step bit for bit, in both scale layouts; unset, it is the
    default (`linear_plan.ROWCOL_DEFAULT`, measured faster on GPUs); a bad value is refused by
    name when the layer plans."""
    from nemo_jetrl.fp8 import linear_plan

    monkeypatch.setenv(gemm_backends.ENV_GEMM_BACKEND, "reference")
    if layout == "mn_major":
        monkeypatch.setattr(linear_plan, "MN_MAJOR_GEMMS", frozenset({"reference"}))
    monkeypatch.setattr(linear, "quant_backend", lambda x, backend=None: "triton")
    calls = []
    real = linear.quantize_rowcol_triton
    monkeypatch.setattr(
        linear, "quantize_rowcol_triton", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    monkeypatch.setenv(linear_plan.ENV_ROWCOL, "fused")
    fused = _layer()
    want = [_step(fused).detach(), _step.last_dx, fused.weight.grad, fused.bias.grad]
    assert fused.fp8_state.plan.x_layout == layout and calls == [1, 1]  # x, then dy
    monkeypatch.setenv(linear_plan.ENV_ROWCOL, "two_pass")
    layer = _layer()
    got = [_step(layer).detach(), _step.last_dx, layer.weight.grad, layer.bias.grad]
    assert layer.fp8_state.plan.two_pass_rowcol and calls == [1, 1]  # the fused kernel not again
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    monkeypatch.delenv(linear_plan.ENV_ROWCOL)
    layer = _layer()
    _step(layer)
    assert layer.fp8_state.plan.two_pass_rowcol and calls == [1, 1]  # the default: two passes
    monkeypatch.setenv(linear_plan.ENV_ROWCOL, "both")
    with pytest.raises(ValueError, match="JETRL_FP8_ROWCOL is 'both'; use fused or two_pass"):
        _step(_layer())
