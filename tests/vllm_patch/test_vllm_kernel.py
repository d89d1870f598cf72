"""Our block-FP8 kernel as a vLLM kernel class, without an engine (fast; needs vLLM).

The engine test (test_vllm_engine.py) runs power-of-two scales end to end; this one covers the
FP32-scale mode and the kernel's contract with vLLM's selector directly on vLLM's own config and
quant-key types.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.vllm


def _config(act_group=(1, 128), weight_group=(128, 128), static=False, shape=(256, 384)):
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
        FP8ScaledMMLinearLayerConfig,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        create_fp8_quant_key,
    )

    return FP8ScaledMMLinearLayerConfig(
        weight_quant_key=create_fp8_quant_key(static=True, group_shape=GroupShape(*weight_group)),
        activation_quant_key=create_fp8_quant_key(
            static=static, group_shape=GroupShape(*act_group)
        ),
        weight_shape=shape,
        input_dtype=torch.bfloat16,
        out_dtype=torch.bfloat16,
    )


def _layer(w_bf16, pow2):
    from nemo_jetrl.fp8 import quantize_blockwise

    q = quantize_blockwise(w_bf16, (128, 128), pow2_scales=pow2)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(q.data, requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(q.scale_inv, requires_grad=False)
    return layer, q


@pytest.mark.parametrize("pow2", [True, False])
def test_kernel_quantizes_with_nemo_jetrl_in_both_scale_modes(pow2):
    from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise
    from nemo_jetrl.vllm_patch.kernel import make_kernel_class
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    cls = make_kernel_class(PatchSettings(pow2_weight_scales=pow2, pow2_activation_scales=pow2))
    kernel = cls(_config())
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(256, 384, generator=g) * 0.05).to(torch.bfloat16)
    # Rows with tiny magnitudes: vLLM's own quantizer floors their scale, ours must not.
    x = torch.randn(3, 5, 384, generator=g).to(torch.bfloat16)
    x[0, 0] *= 1e-4
    layer, qw = _layer(w, pow2)
    weight_before = layer.weight
    kernel.process_weights_after_loading(layer)
    assert layer.weight is weight_before  # nothing repacked or replaced
    layer._jetrl_capture = collections.deque(maxlen=4)
    y = kernel.apply_weights(layer, x)
    assert y.shape == (3, 5, 256) and y.dtype == torch.bfloat16

    ((x2, q, s),) = layer._jetrl_capture
    ref = quantize_blockwise(x.reshape(-1, 384), (1, 128), pow2_scales=pow2)
    assert torch.equal(x2, x.reshape(-1, 384))
    assert torch.equal(fp8_bits(q), fp8_bits(ref.data))
    assert torch.equal(s, ref.scale_inv)
    # Output against float64 on the dequantized operands: fp32 accumulation over K=384 plus the
    # final bf16 rounding (relative 2**-8).
    exact = ref.dequantize(torch.float64) @ qw.dequantize(torch.float64).t()
    bound = (
        384
        * 2**-24
        * (ref.dequantize(torch.float64).abs() @ qw.dequantize(torch.float64).abs().t())
    )
    err = (y.reshape(-1, 256).double() - exact).abs()
    assert bool((err <= bound + exact.abs() * 2**-8 + 1e-30).all())


def test_biased_layer_adds_its_bias_in_fp32_and_rounds_once_as_the_trainer():
    """Qwen2's q/k/v carry biases: the trainer adds them to the fp32 accumulator and rounds once
    (TE's epilogue, `fp8_linear_forward`). Adding them after a bf16 GEMM output rounds twice and
    moved 27% of a [64, 384] x [256, 384] layer's outputs by one bf16 step (found with the
    shared-experts engine test). Bit for bit against the trainer's forward on the same operands."""
    from nemo_jetrl.fp8 import quantize_blockwise
    from nemo_jetrl.fp8.linear import fp8_linear_forward
    from nemo_jetrl.vllm_patch.kernel import make_kernel_class
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(256, 384, generator=g) * 0.05).to(torch.bfloat16)
    bias = (torch.randn(256, generator=g) * 0.5).to(torch.bfloat16)
    x = torch.randn(64, 384, generator=g).to(torch.bfloat16)
    kernel = make_kernel_class(PatchSettings())(_config())
    layer, qw = _layer(w, True)
    layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    kernel.process_weights_after_loading(layer)
    assert layer.jetrl_bias_gemm_backend in ("reference", "scaled_mm", "triton")  # fp32 out
    y = kernel.apply_weights(layer, x, bias=layer.bias)
    qx = quantize_blockwise(x, (1, 128), pow2_scales=True)
    want = fp8_linear_forward(qx, qw, bias, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    twice = (fp8_linear_forward(qx, qw, None, torch.bfloat16) + bias).to(torch.bfloat16)
    assert not torch.equal(twice, want)  # the old rule differs on these operands
    assert torch.equal(
        kernel.apply_weights(layer, x), fp8_linear_forward(qx, qw, None, torch.bfloat16)
    )


def test_a_biased_layer_compiles_whole_without_our_load_step():
    """NeMo-RL replaces vLLM's Fp8LinearMethod.process_weights_after_loading with its own, which
    never calls the kernel's (v0.7.0 quantization/fp8.py): the fp32-output GEMM of a biased layer
    (Qwen2/2.5 q/k/v) was then planned in the first forward, which vLLM runs under torch.compile
    with fullgraph=True, where planning raised ``torch._dynamo.exc.Unsupported`` (helper review,
    2026-12-01; NeMo-RL's enforce_eager default is false). Now it is planned at the kernel's
    construction, and the compiled forward gives the eager one's bits."""
    from nemo_jetrl.vllm_patch.kernel import make_kernel_class
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    g = torch.Generator().manual_seed(4)
    w = (torch.randn(256, 384, generator=g) * 0.05).to(torch.bfloat16)
    kernel = make_kernel_class(PatchSettings())(_config())
    layer, _ = _layer(w, True)
    layer.bias = torch.nn.Parameter(torch.randn(256, generator=g).to(torch.bfloat16), False)
    x = torch.randn(4, 384, generator=g).to(torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda t: kernel.apply_weights(layer, t, layer.bias), fullgraph=True, backend="eager"
    )
    y = compiled(x)
    assert not hasattr(layer, "jetrl_bias_gemm_backend")  # no load step of ours ran
    assert torch.equal(y, kernel.apply_weights(layer, x, layer.bias))


def test_kernel_propagates_nan_like_vllm_without_stopping_the_engine():
    """A NaN token (vLLM's warm-up feeds placeholders) gives NaN in its row only."""
    from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise
    from nemo_jetrl.vllm_patch.kernel import make_kernel_class
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    kernel = make_kernel_class(PatchSettings())(_config())
    layer, _ = _layer((torch.randn(256, 384) * 0.05).to(torch.bfloat16), True)
    x = torch.randn(4, 384).to(torch.bfloat16)
    x[1, 7] = float("nan")
    layer._jetrl_capture = collections.deque(maxlen=1)
    y = kernel.apply_weights(layer, x)
    assert bool(y[1].isnan().all()) and bool(torch.isfinite(y[[0, 2, 3]]).all())
    ((_, q, s),) = layer._jetrl_capture
    ref = quantize_blockwise(x[[0, 2, 3]], (1, 128))
    assert torch.equal(fp8_bits(q[[0, 2, 3]]), fp8_bits(ref.data))
    assert torch.equal(s[[0, 2, 3]], ref.scale_inv)


def test_kernel_accepts_only_block_fp8_dynamic():
    from nemo_jetrl.vllm_patch.kernel import make_kernel_class
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    cls = make_kernel_class(PatchSettings())
    assert cls.is_supported() == (True, None)
    assert cls.can_implement(_config()) == (True, None)
    ok, why = cls.can_implement(_config(act_group=(1, 64), weight_group=(64, 64)))
    assert not ok and "(1, 128)" in why
    ok, why = cls.can_implement(_config(static=True))
    assert not ok and "dynamic" in why


def test_kernel_refuses_wrong_scale_layout():
    from nemo_jetrl.vllm_patch.kernel import make_kernel_class
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    kernel = make_kernel_class(PatchSettings())(_config())
    layer, _ = _layer(torch.randn(256, 384).to(torch.bfloat16), True)
    layer.weight_scale_inv = torch.nn.Parameter(torch.ones(1, 3), requires_grad=False)
    with pytest.raises(
        ValueError, match=r"expected float8_e4m3fn and fp32 scales of shape \(2, 3\)"
    ):
        kernel.process_weights_after_loading(layer)


def test_register_and_unregister_in_vllm_registry():
    """Ours goes first for this platform; revert restores vLLM's registry exactly, including
    vLLM 0.20's missing CPU entry (which we create, then delete again)."""
    import vllm
    from vllm.platforms import current_platform

    from nemo_jetrl.vllm_patch.compat import release
    from nemo_jetrl.vllm_patch.kernel import (
        fp8_block_registry,
        register_kernel,
        registered_kernel,
        unregister_kernel,
    )
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    assert registered_kernel() is None, "an earlier test left the patch applied"
    plat = current_platform._enum
    before = {k: list(v) for k, v in fp8_block_registry().items()}
    if current_platform.is_cpu():
        # vLLM 0.20 has no CPU block-FP8 kernel list at all; 0.25 and 0.32 have one (AMX kernels).
        assert (plat in before) == (release(vllm.__version__) >= (0, 21, 0))
    cls = register_kernel(PatchSettings())
    try:
        assert fp8_block_registry()[plat][0] is cls
        assert fp8_block_registry()[plat][1:] == before.get(plat, [])
        assert register_kernel(PatchSettings()) is cls  # idempotent
        with pytest.raises(RuntimeError, match="different settings"):
            register_kernel(PatchSettings(pow2_activation_scales=False))
    finally:
        assert unregister_kernel() == 1
    assert {k: list(v) for k, v in fp8_block_registry().items()} == before
    assert unregister_kernel() == 0


# ------------------------------------------------- serving path: sync-free, GEMM planned once


def test_op_impls_read_nothing_on_the_host(monkeypatch):
    """The custom ops' bodies hold no host read (a sync per layer on CUDA, an error in CUDA-graph
    capture): on CPU as they run here, and with the quantizer routed to the Triton kernel as
    on CUDA (interpreter). The checked quantizer is caught by the same detector."""
    import functools

    from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise
    from nemo_jetrl.fp8.sync_check import HostReadError, no_host_reads
    from nemo_jetrl.vllm_patch import kernel, serving_ops

    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 384, generator=g).to(torch.bfloat16)
    w = quantize_blockwise(
        (torch.randn(256, 384, generator=g) * 0.05).to(torch.bfloat16), (128, 128)
    )
    ref = quantize_blockwise(x, (1, 128), pow2_scales=False)
    device = kernel._serving_device()  # the CPU here; the GPU in the GPU image
    x, wd, ws = x.to(device), w.data.to(device), w.scale_inv.to(device)
    backend = kernel.plan_gemm(device, out_dtype=torch.bfloat16, pow2_scales=False).backend
    routes = {"default": quantize_blockwise}
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if importlib.util.find_spec("triton") is not None and (x.is_cuda or interpreted):
        routes["triton (as on CUDA)"] = functools.partial(quantize_blockwise, backend="triton")
    for route, quantizer in routes.items():
        monkeypatch.setattr(serving_ops, "quantize_blockwise", quantizer)
        kernel._quantize_act_impl(x, False, 0.0)  # Triton compiles outside the detector
        with no_host_reads() as mode:
            q, s = kernel._quantize_act_impl(x, False, 0.0)
            out = kernel._gemm_impl(q, s, wd, ws, torch.bfloat16, False, True, backend)
        assert mode.ops_seen > 0 and out.shape == (40, 256), route
        assert torch.equal(fp8_bits(q.cpu()), fp8_bits(ref.data))
        assert torch.equal(s.cpu(), ref.scale_inv)
    monkeypatch.setattr(serving_ops, "quantize_blockwise", quantize_blockwise)
    with pytest.raises(HostReadError), no_host_reads():
        quantize_blockwise(x, (1, 128))


def test_gemm_backend_is_chosen_once_per_layer_and_readable(monkeypatch):
    from nemo_jetrl.vllm_patch import kernel, serving_ops
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    plans, runs = [], []
    real_plan, real_run = kernel.plan_gemm, serving_ops.run_gemm
    monkeypatch.setattr(kernel, "plan_gemm", lambda *a, **k: plans.append(k) or real_plan(*a, **k))
    monkeypatch.setattr(serving_ops, "run_gemm", lambda b, *a: runs.append(b) or real_run(b, *a))
    cls = kernel.make_kernel_class(PatchSettings())
    layers = []
    device = kernel._serving_device()  # the CPU here; the GPU in the GPU image
    for _ in range(2):
        kern = cls(_config())
        layer, _ = _layer((torch.randn(256, 384) * 0.05).to(torch.bfloat16).to(device), True)
        kern.process_weights_after_loading(layer)
        layers.append((kern, layer))
    # per layer, at construction: its GEMM (bf16 out) and a biased forward's (fp32 out)
    outs = [torch.bfloat16, torch.float32] * 2
    assert [p["out_dtype"] for p in plans] == outs
    for _ in range(3):
        for kern, layer in layers:
            kern.apply_weights(layer, torch.randn(2, 384).to(torch.bfloat16).to(device))
    assert len(plans) == 4  # nothing re-decided per call
    planned = layers[0][0].jetrl_gemm_backend
    assert runs == [planned] * 6
    assert all(layer.jetrl_gemm_backend == planned for _, layer in layers)
    gpu_backends = ("deep_gemm", "scaled_mm", "triton")
    assert planned in (gpu_backends if device.type == "cuda" else ("reference",))
    # Weights that live elsewhere than planned (e.g. offloaded to CPU) are planned for where
    # they are, once, at load.
    kern = cls(_config())
    layer, _ = _layer((torch.randn(256, 384) * 0.05).to(torch.bfloat16), True)
    kern.process_weights_after_loading(layer)
    assert layer.jetrl_gemm_backend == "reference"
    assert len(plans) == 6 + (device.type == "cuda")


def test_output_dtype_no_gpu_backend_writes_is_refused_at_kernel_init(monkeypatch):
    """Stand-in GPU (capabilities only; nothing runs): an H100 without triton cannot write fp16
    (DeepGEMM and cuBLASLt blockwise write bf16), so building the kernel fails, naming why."""
    from nemo_jetrl.fp8 import gemm_backends
    from nemo_jetrl.fp8.gemm_backends import DeviceCaps
    from nemo_jetrl.vllm_patch import kernel
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    caps = DeviceCaps(cuda=True, sm=(9, 0), deep_gemm=True, scaled_mm=True, triton=False)
    monkeypatch.setattr(gemm_backends, "device_caps", lambda device: caps)
    monkeypatch.setattr(kernel, "_serving_device", lambda: torch.device("cuda", 0))
    gemm_backends._plan_cached.cache_clear()
    try:
        cls = kernel.make_kernel_class(PatchSettings())
        assert cls(_config()).jetrl_gemm_backend == "deep_gemm"
        fp16 = _config()
        object.__setattr__(fp16, "out_dtype", torch.float16)
        with pytest.raises(ValueError) as err:
            cls(fp16)
        msg = str(err.value)
        assert "torch.float16" in msg and "bfloat16 only" in msg and "pip install triton" in msg
    finally:
        gemm_backends._plan_cached.cache_clear()


def test_deep_gemm_is_found_through_vllms_wrapper_and_vendored_module():
    """vLLM (0.20 to 0.33) wraps DeepGEMM in ``vllm.utils.deep_gemm``, which falls back to the copy
    vendored in its CUDA wheel (``vllm.third_party.deep_gemm``). The CPU build has no vendored
    copy: a labelled stand-in module takes its place, in a subprocess (vLLM caches what it finds).
    Our runner must reach the stand-in through vLLM's real wrapper, asking for no UE8M0 cast."""
    code = textwrap.dedent(
        """
        import importlib.machinery, sys, types
        import torch
        sys.modules["deep_gemm"] = None  # no pip-installed DeepGEMM
        standin = types.ModuleType("vllm.third_party.deep_gemm")  # stand-in: needs a GPU
        standin.__spec__ = importlib.machinery.ModuleSpec("vllm.third_party.deep_gemm", None)
        seen = {}
        def fp8_gemm_nt(a, b, out, **kw):
            seen.update(kw)
            out.fill_(3.0)
        standin.fp8_gemm_nt = fp8_gemm_nt
        sys.modules["vllm.third_party.deep_gemm"] = standin
        from nemo_jetrl.fp8 import gemm_backends, quantize_blockwise
        # Not inside a vLLM process (a trainer): vLLM is not imported to reach its copy.
        assert gemm_backends.deep_gemm_module() is None and "vllm.utils" not in sys.modules
        gemm_backends.deep_gemm_module.cache_clear()
        import vllm  # as in a vLLM worker
        module = gemm_backends.deep_gemm_module()
        assert module is not None and module.__name__ == "vllm.utils.deep_gemm", module
        a = quantize_blockwise(torch.randn(4, 256), (1, 128))
        b = quantize_blockwise(torch.randn(128, 256), (128, 128))
        out = gemm_backends.run_gemm("deep_gemm", a, b, torch.bfloat16)
        assert bool((out == 3).all()) and seen == {"disable_ue8m0_cast": True}, seen
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [True, False])
def test_gpu_kernel_apply_is_captured_in_a_cuda_graph(pow2):
    """The layer's whole forward (quantize op + planned GEMM) captured and replayed like vLLM's
    FULL cudagraph mode: same bits as eager, activations bit-identical to nemo_jetrl.fp8."""
    from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise
    from nemo_jetrl.vllm_patch.kernel import make_kernel_class
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    cls = make_kernel_class(PatchSettings(pow2_weight_scales=pow2, pow2_activation_scales=pow2))
    kern = cls(_config(shape=(512, 1024)))
    w = (torch.randn(512, 1024) * 0.05).to(torch.bfloat16).cuda()
    layer, _ = _layer(w, pow2)
    kern.process_weights_after_loading(layer)
    assert layer.jetrl_gemm_backend in ("deep_gemm", "scaled_mm", "triton")
    x = torch.randn(64, 1024, device="cuda").to(torch.bfloat16)
    eager = kern.apply_weights(layer, x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kern.apply_weights(layer, x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, kern.apply_weights(layer, x))
    assert not torch.equal(captured, eager)
    layer._jetrl_capture = collections.deque(maxlen=1)
    kern.apply_weights(layer, x)
    ((_, q, s),) = layer._jetrl_capture
    ref = quantize_blockwise(x.cpu(), (1, 128), pow2_scales=pow2)
    assert torch.equal(fp8_bits(q.cpu()), fp8_bits(ref.data)) and torch.equal(
        s.cpu(), ref.scale_inv
    )


def test_guard_report_reads_the_planned_gemm_backend():
    """The guard's worker report (``guard.layer_kernel_report``) names our kernel and the GEMM
    backend planned for the layer, read from ``kernel.jetrl_gemm_backend``."""
    import types

    from nemo_jetrl.vllm_patch.guard import layer_kernel_report
    from nemo_jetrl.vllm_patch.kernel import make_kernel_class
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    kern = make_kernel_class(PatchSettings())(_config())
    layer, _ = _layer((torch.randn(256, 384) * 0.05).to(torch.bfloat16), True)
    kern.process_weights_after_loading(layer)
    layer.quant_method = types.SimpleNamespace(fp8_linear=kern)
    model = torch.nn.Module()
    model.proj = layer
    report = layer_kernel_report(model)["layers"]["proj"]
    assert report["ours"] and report["gemm_backend"] == layer.jetrl_gemm_backend == "reference"
