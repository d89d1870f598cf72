"""GEMM backend planning (decided once, dtype guards) and the Triton block GEMM (interpreter on CPU).

The decision is a pure function of `DeviceCaps`, so every GPU configuration is checked here on
CPU; the kernels themselves on a GPU are in the `gpu` tests at the end.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from nemo_jetrl.fp8 import (
    BlockQuantized,
    dispatch,
    fp8_bits,
    gemm_backends,
    gemm_layouts,
    quantize_blockwise,
)
from nemo_jetrl.fp8.gemm_backends import DeviceCaps, GemmBackendError, decide
from nemo_jetrl.fp8.sync_check import no_host_reads

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
H100 = DeviceCaps(cuda=True, sm=(9, 0), deep_gemm=True, scaled_mm=True, triton=True)
H100_NO_DG = DeviceCaps(cuda=True, sm=(9, 0), scaled_mm=True, triton=True)
B200 = DeviceCaps(cuda=True, sm=(10, 0), deep_gemm=True, scaled_mm=True, triton=True)
E4M3 = ("e4m3", "e4m3")
# The `triton` tests run compiled on a GPU, in Triton's interpreter on CPU (conftest sets it).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    monkeypatch.delenv(gemm_backends.ENV_GEMM_BACKEND, raising=False)
    gemm_backends._plan_cached.cache_clear()
    yield
    gemm_backends._plan_cached.cache_clear()


def _plan(caps, out=BF16, pow2=True, kind="fprop", fmts=("e4m3", "e4m3"), forced="auto"):
    return decide(caps, out_dtype=out, pow2_scales=pow2, kind=kind, fmts=fmts, forced=forced)


@pytest.mark.parametrize(
    ("caps", "out", "pow2", "kind", "fmts", "want"),
    [
        (DeviceCaps(cuda=False), BF16, True, "fprop", E4M3, "reference"),
        (H100, BF16, False, "fprop", E4M3, "deep_gemm"),
        (H100, FP16, True, "fprop", E4M3, "triton"),  # DeepGEMM/cuBLASLt: no fp16 out
        (H100, FP32, True, "fprop", E4M3, "triton"),
        (H100, BF16, True, "wgrad", E4M3, "scaled_mm"),
        (H100, BF16, True, "fprop", ("e5m2", "e4m3"), "triton"),  # hybrid recipe DGrad
        (H100_NO_DG, BF16, True, "fprop", E4M3, "scaled_mm"),
        (B200, BF16, True, "fprop", E4M3, "deep_gemm"),
        # SM100 DeepGEMM would round FP32 scales to UE8M0; cuBLASLt blockwise is SM90 only
        (B200, BF16, False, "fprop", E4M3, "triton"),
        (DeviceCaps(True, (8, 0), triton=True), BF16, True, "fprop", E4M3, "triton"),
    ],
)
def test_decision_table(caps, out, pow2, kind, fmts, want):
    assert _plan(caps, out, pow2, kind, fmts).backend == want


def test_no_gpu_backend_is_refused_at_planning_naming_dtype_and_fix():
    caps = DeviceCaps(cuda=True, sm=(9, 0), deep_gemm=True, scaled_mm=True, triton=False)
    assert _plan(caps, BF16).backend == "deep_gemm"
    with pytest.raises(GemmBackendError) as err:
        _plan(caps, FP16)
    msg = str(err.value)
    assert "torch.float16" in msg and "bfloat16 only" in msg and "pip install triton" in msg
    assert "dequantizing the weights on every call is not offered" in msg
    with pytest.raises(GemmBackendError, match="sm_80"):
        _plan(DeviceCaps(cuda=True, sm=(8, 0), deep_gemm=True), BF16)


def test_forced_backend_that_cannot_run_is_refused():
    with pytest.raises(GemmBackendError, match=r"'deep_gemm' was requested .* bfloat16 only"):
        _plan(H100, FP16, forced="deep_gemm")
    with pytest.raises(GemmBackendError, match="scaled_mm needs E4M3"):
        _plan(H100, BF16, fmts=("e5m2", "e4m3"), forced="scaled_mm")
    with pytest.raises(GemmBackendError, match="needs CUDA operands"):
        _plan(DeviceCaps(cuda=False), forced="scaled_mm")
    with pytest.raises(GemmBackendError, match="TRITON_INTERPRET=1"):
        _plan(DeviceCaps(cuda=False), forced="triton")
    assert _plan(H100, FP16, forced="reference").backend == "reference"  # explicit debugging


def test_plan_is_decided_once_per_signature(monkeypatch):
    calls = []
    real = gemm_backends.decide

    def counting(*args, **kwargs):
        calls.append(kwargs["out_dtype"])
        return real(*args, **kwargs)

    monkeypatch.setattr(gemm_backends, "decide", counting)
    g = torch.Generator().manual_seed(0)
    a = quantize_blockwise(torch.randn(8, 256, generator=g), (1, 128))
    b = quantize_blockwise(torch.randn(128, 256, generator=g), (128, 128))
    for _ in range(3):
        dispatch.fp8_gemm(a, b)
        dispatch.fp8_gemm(a, b, out_dtype=FP32)
    assert calls == [BF16, FP32]


# ----------------------------------------------------------------------------- DeepGEMM lookup


def test_deep_gemm_found_without_vllm_and_called_with_compact_scales(monkeypatch):
    """Stand-in for a pip-installed ``deep_gemm`` (the real one needs a GPU): the runner hands
    it the FP8 data, the fp32 scales and a preallocated output, as DeepGEMM's API takes them."""
    seen = {}

    def fp8_gemm_nt(a, b, out):
        seen.update(a=a, b=b)
        out.fill_(1.0)

    standin = types.ModuleType("deep_gemm")
    standin.fp8_gemm_nt = fp8_gemm_nt
    monkeypatch.setitem(sys.modules, "deep_gemm", standin)
    monkeypatch.setitem(sys.modules, "vllm", None)  # no vLLM: the package itself is used
    gemm_backends.deep_gemm_module.cache_clear()
    try:
        assert gemm_backends.deep_gemm_module() is standin
        a = quantize_blockwise(torch.randn(4, 256), (1, 128))
        b = quantize_blockwise(torch.randn(128, 256), (128, 128))
        out = gemm_backends.run_gemm("deep_gemm", a, b, BF16)
        assert out.shape == (4, 128) and out.dtype == BF16 and bool((out == 1).all())
        assert seen["a"][0] is a.data and seen["a"][1] is a.scale_inv
    finally:
        gemm_backends.deep_gemm_module.cache_clear()


# ------------------------------------------------------------------------- Triton block GEMM


def _to(q: BlockQuantized, device: str) -> BlockQuantized:
    return BlockQuantized(q.data.to(device), q.scale_inv.to(device), q.block, q.fmt, q.pow2_scales)


# Hopper's FP8 tensor-core dot (Triton's native tl.dot on SM90, wgmma) keeps ~14 bits when it
# adds its products (DeepSeek-V3 report, sec. 3.3.2; seen here on an H100: 512 ulp off on exactly
# representable sums, benchmarks/gpu/results/README.md). Each group of 32 products then loses at
# most 32 * 2**-14 of its largest product's size: <= 2**-9 of the group's |A||B|.
HOPPER_FP8_DOT = 2**-9


def _native(a: BlockQuantized, b: BlockQuantized) -> bool:
    from nemo_jetrl.fp8.triton_gemm import native_dot

    return DEVICE == "cuda" and native_dot((a.fmt, b.fmt), torch.cuda.get_device_capability())


def _bound_check(out: torch.Tensor, a: BlockQuantized, b: BlockQuantized) -> None:
    """Within fp32 accumulation over K (``K * 2**-24 * |A||B|^T``) plus the output rounding, plus
    `HOPPER_FP8_DOT` of ``|A||B|^T`` where the GPU's FP8 dot runs (`_native`)."""
    da, db = a.dequantize(torch.float64), b.dequantize(torch.float64)
    exact = da @ db.t()
    k = a.data.shape[1]
    unit = {BF16: 2**-8, FP16: 2**-11, FP32: 2**-24}[out.dtype]
    dot = k * 2**-24 + (HOPPER_FP8_DOT if _native(a, b) else 0.0)
    bound = dot * (da.abs() @ db.abs().t()) + unit * exact.abs() + 1e-30
    assert bool(((out.double() - exact).abs() <= bound).all())


@pytest.mark.triton
@pytest.mark.parametrize("pow2", [True, False])
def test_triton_gemm_matches_float64_for_every_pair_and_dtype(pow2):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(70, 300, generator=g) * torch.logspace(-2, 2, 300)).to(BF16)
    w = (torch.randn(200, 300, generator=g) * 0.05).to(BF16)
    cases = [
        (quantize_blockwise(x, (1, 128), pow2_scales=pow2), (128, 128), "e4m3", BF16),
        (quantize_blockwise(x, (1, 128), pow2_scales=pow2), (128, 128), "e4m3", FP16),
        (quantize_blockwise(x, (1, 128), pow2_scales=pow2), (1, 128), "e4m3", FP32),
        (quantize_blockwise(x, (1, 128), fmt="e5m2", pow2_scales=pow2), (128, 128), "e4m3", BF16),
    ]
    for a, wblock, wfmt, out_dtype in cases:
        b = quantize_blockwise(w, wblock, fmt=wfmt, pow2_scales=pow2)
        out = gemm_backends.run_gemm("triton", _to(a, DEVICE), _to(b, DEVICE), out_dtype)
        assert out.shape == (70, 200) and out.dtype == out_dtype
        _bound_check(out.cpu(), a, b)


@pytest.mark.triton
def test_triton_gemm_never_dequantizes_and_never_reads_the_host(monkeypatch):
    a = _to(quantize_blockwise(torch.randn(20, 256), (1, 128)), DEVICE)
    b = _to(quantize_blockwise(torch.randn(130, 256), (128, 128)), DEVICE)

    def forbidden(*_a, **_k):
        raise AssertionError("an operand was dequantized")

    monkeypatch.setattr(BlockQuantized, "dequantize", forbidden)
    from nemo_jetrl.fp8 import triton_gemm

    triton_gemm.prepare(torch.device(DEVICE), ("e4m3", "e4m3"))
    gemm_backends.run_gemm("triton", a, b, BF16)  # compiles (on a GPU) outside the detector
    with no_host_reads() as mode:
        out = gemm_backends.run_gemm("triton", a, b, BF16)
    assert mode.ops_seen > 0 and out.shape == (20, 130)


# ----------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_plan_never_picks_the_reference_and_guards_fp16():
    dev = torch.device("cuda", torch.cuda.current_device())
    for out in (BF16, FP16, FP32):
        plan = gemm_backends.plan_gemm(dev, out_dtype=out, pow2_scales=True)
        assert plan.backend in ("deep_gemm", "scaled_mm", "triton")
        if out != BF16:
            assert plan.backend == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [True, False])
def test_gpu_triton_gemm_compiled_matches_float64_and_is_graph_capturable(pow2):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(300, 1024, generator=g).to(BF16).cuda()
    w = (torch.randn(768, 1024, generator=g) * 0.05).to(BF16).cuda()
    a = quantize_blockwise(x, (1, 128), pow2_scales=pow2)
    b = quantize_blockwise(w, (128, 128), pow2_scales=pow2)
    for out_dtype in (BF16, FP16, FP32):
        out = gemm_backends.run_gemm("triton", a, b, out_dtype)
        _bound_check(out.cpu(), _to(a, "cpu"), _to(b, "cpu"))
    graph = torch.cuda.CUDAGraph()
    gemm_backends.run_gemm("triton", a, b, BF16)  # compiled before capture
    with torch.cuda.graph(graph):
        captured = gemm_backends.run_gemm("triton", a, b, BF16)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, gemm_backends.run_gemm("triton", a, b, BF16))


# ------------------------------------------- rules found on the first H100 run (see results/)


def test_scaled_mm_shape_rule_names_the_shape():
    assert gemm_layouts.shape_problem("scaled_mm", 300, 768, 1024) is None
    why = gemm_layouts.shape_problem("scaled_mm", 768, 1024, 300)  # WGrad over 300 tokens
    assert why is not None and "K=300" in why
    assert gemm_layouts.shape_problem("scaled_mm", 64, 264, 128) is not None  # N % 16
    assert gemm_layouts.shape_problem("scaled_mm", 129, 256, 128) is not None  # an expert's M
    assert gemm_layouts.shape_problem("scaled_mm", 4, 256, 128) is None
    assert gemm_layouts.shape_problem("triton", 768, 1024, 300) is None


@pytest.mark.triton
def test_cublaslt_gets_padded_rows_and_a_shape_it_refuses_runs_on_triton(monkeypatch):
    """On a scaled_mm plan, M = 37 (a decode batch) runs cuBLASLt on 40 rows (pow2) or 64 (FP32
    scales: `activation_layout`) and returns the first 37, so a token's row has cuBLASLt's bits
    at every M on the rollout and the trainer alike (it ran on Triton before); K = 300 (WGrad
    over 300 tokens) runs Triton; M = 72 runs cuBLASLt as it is. Runners stood in (no GPU)."""
    ran, handed = [], []

    def standin(name):  # type: ignore[no-untyped-def]
        def run(a, b, out_dtype):  # type: ignore[no-untyped-def]
            ran.append((name, a.data.shape[0]))
            handed.append(a)
            rows = torch.arange(a.data.shape[0], dtype=torch.float32)[:, None]
            return rows.expand(-1, b.data.shape[0]).to(out_dtype)  # row i holds i

        return run

    for name in ("scaled_mm", "triton"):
        monkeypatch.setitem(gemm_backends.RUNNERS, name, standin(name))
    g = torch.Generator().manual_seed(5)

    def q(rows, k, pow2=True):  # type: ignore[no-untyped-def]
        return quantize_blockwise(torch.randn(rows, k, generator=g), (1, 128), pow2_scales=pow2)

    monkeypatch.setattr(
        gemm_backends, "device_caps", lambda dev: DeviceCaps(cuda=True, triton=True)
    )
    for m, k, pow2 in ((70, 300, True), (37, 256, True), (72, 256, True), (37, 256, False)):
        a = q(m, k, pow2)
        out = gemm_backends.run_gemm("scaled_mm", a, q(64, k, pow2), BF16)
        assert out.shape == (m, 64) and torch.equal(out[:, 0], torch.arange(m).to(BF16)), m
    assert ran == [("triton", 70), ("scaled_mm", 40), ("scaled_mm", 72), ("scaled_mm", 64)]
    padded = handed[-1]  # the FP32-scale call: 37 rows, then zero codes with scale 1
    assert torch.equal(fp8_bits(padded.data[:37]), fp8_bits(a.data))
    assert torch.equal(padded.scale_inv[:37], a.scale_inv)
    assert not fp8_bits(padded.data[37:]).any() and bool((padded.scale_inv[37:] == 1).all())
    monkeypatch.setattr(gemm_backends, "device_caps", lambda dev: DeviceCaps(cuda=True))
    with pytest.raises(GemmBackendError, match=r"K=300.*triton is not installed"):
        gemm_backends.run_gemm("scaled_mm", q(70, 300), q(64, 300), BF16)
