"""Our block-FP8 kernel as a vLLM kernel class, without an engine (needs vLLM): how it runs its
GEMM. The op implementations read nothing on the host, the GEMM backend is chosen once per layer
and readable (and by the guard report), an output dtype no GPU backend writes is refused at kernel
init, DeepGEMM is found through vLLM's wrapper, and on a GPU the kernel's apply is captured in a
CUDA graph. The scale modes, the bias and the kernel's contract with vLLM's selector:
test_vllm_kernel.py, whose helpers these tests share.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_vllm_kernel import REPO, _config, _layer

pytestmark = pytest.mark.vllm


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
