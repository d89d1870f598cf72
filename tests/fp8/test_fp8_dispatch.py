"""Backend dispatch: CPU behaviour always; the GPU paths (Triton, DeepGEMM, scaled_mm) under `gpu`."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from nemo_jetrl.fp8 import dispatch, fp8_bits, quantize_blockwise
from nemo_jetrl.fp8.gemm import blockwise_matmul


def _operands(m=96, n=256, k=384, seed=0, device="cpu", pow2=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    a = quantize_blockwise(x.to(device), (1, 128), pow2_scales=pow2)
    b = quantize_blockwise(w.to(device), (128, 128), pow2_scales=pow2)
    return a, b


# ----------------------------------------------------------------------------------------- CPU


def test_fp8_imports_and_quantizes_without_triton():
    code = textwrap.dedent(
        """
        import os, sys
        sys.modules["triton"] = None  # import triton -> ImportError
        import torch
        from nemo_jetrl.fp8 import quantize_blockwise, dispatch, triton_kernels
        from nemo_jetrl.fp8._deps import Fp8DependencyError
        q = quantize_blockwise(torch.ones(4, 128), (1, 128))
        assert float(q.scale_inv[0, 0]) == 1 / 256  # pow2: 448 rounds down to 256
        assert not triton_kernels.triton_available()
        assert dispatch.quant_backend(torch.ones(4, 128)) == "torch"
        try:
            quantize_blockwise(torch.ones(4, 128), (1, 128), backend="triton")
        except RuntimeError as e:
            assert "cannot run here" in str(e), e
        else:
            raise AssertionError("backend='triton' without triton must fail")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            triton_kernels.quantize_blockwise_triton(torch.ones(4, 128), (1, 128))
        except Fp8DependencyError as e:
            assert "pip install" in str(e), e
        else:
            raise AssertionError("expected Fp8DependencyError")
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_cpu_defaults_to_torch_reference(monkeypatch):
    x = torch.randn(8, 256)
    monkeypatch.delenv(dispatch.ENV_QUANT_BACKEND, raising=False)
    assert dispatch.quant_backend(x) == "torch"
    assert dispatch.quant_backend(x, "auto") == "torch"
    q = quantize_blockwise(x, (1, 128), backend="torch")
    assert torch.equal(fp8_bits(q.data), fp8_bits(quantize_blockwise(x, (1, 128)).data))


def test_bad_backend_names_the_source(monkeypatch):
    x = torch.randn(8, 256)
    with pytest.raises(ValueError, match="backend argument is 'gpu'"):
        dispatch.quant_backend(x, "gpu")
    monkeypatch.setenv(dispatch.ENV_QUANT_BACKEND, "fast")
    with pytest.raises(ValueError, match=dispatch.ENV_QUANT_BACKEND):
        dispatch.quant_backend(x)
    monkeypatch.setenv(dispatch.ENV_GEMM_BACKEND, "cutlass")
    a, b = _operands()
    with pytest.raises(ValueError, match=dispatch.ENV_GEMM_BACKEND):
        dispatch.fp8_gemm(a, b)


def test_gemm_on_cpu_is_the_reference(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_GEMM_BACKEND, raising=False)
    a, b = _operands()
    assert dispatch.gemm_backend(a, b) == "reference"
    out = dispatch.fp8_gemm(a, b)
    assert out.dtype == torch.bfloat16 and out.shape == (96, 256)
    assert torch.equal(out, blockwise_matmul(a, b, out_dtype=torch.bfloat16))
    # WGrad-style operands (both 1x128 along tokens) also go to the reference
    assert dispatch.gemm_backend(a, a) == "reference"


def test_fast_gemm_refuses_unsupported_operands():
    a, b = _operands()
    a5 = quantize_blockwise(a.dequantize(torch.bfloat16), (1, 128), fmt="e5m2")
    with pytest.raises(ValueError, match="scaled_mm needs E4M3 operands"):
        dispatch.fp8_gemm(a5, b, backend="scaled_mm")
    with pytest.raises(ValueError, match="deep_gemm needs E4M3 operands"):
        dispatch.fp8_gemm(a, a, backend="deep_gemm")  # WGrad pair: not a DeepGEMM SM90 path
    with pytest.raises(ValueError, match="use backend='reference'"):
        dispatch.fp8_gemm(b, b, backend="triton")  # a must be 1x128


# ----------------------------------------------------------------------------------------- GPU


def _fast_gemm_backends() -> list[str]:
    from nemo_jetrl.fp8 import gemm_backends

    major, _ = torch.cuda.get_device_capability()
    found = ["triton"]
    if gemm_backends.deep_gemm_module() is not None and major in (9, 10):
        found.append("deep_gemm")
    if major == 9 and gemm_backends._cuda_at_least(12, 9):
        found.append("scaled_mm")
    return found


@pytest.mark.gpu
def test_quantize_blockwise_on_cuda_uses_triton_and_matches_reference(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_QUANT_BACKEND, raising=False)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(1000, 4096, generator=g) * torch.logspace(-20, 20, 4096)).to(torch.bfloat16)
    x[:, :128] = 0
    assert dispatch.quant_backend(x.cuda()) == "triton"
    for block in ((1, 128), (128, 128), (128, 1)):
        for fmt in ("e4m3", "e5m2"):
            for pow2 in (True, False):
                got = quantize_blockwise(x.cuda(), block, fmt=fmt, pow2_scales=pow2)
                want = quantize_blockwise(x, block, fmt=fmt, pow2_scales=pow2)
                assert torch.equal(fp8_bits(got.data.cpu()), fp8_bits(want.data))
                assert torch.equal(got.scale_inv.cpu().view(torch.int32),
                                   want.scale_inv.view(torch.int32))  # fmt: skip


@pytest.mark.gpu
def test_native_hardware_cast_agrees_with_integer_cast():
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(512, 2048, generator=g) * torch.logspace(-30, 30, 2048)).cuda()
    for fmt in ("e4m3", "e5m2"):
        for block in ((1, 128), (128, 128), (128, 1)):
            soft = quantize_blockwise_triton(x, block, fmt=fmt)
            hard = quantize_blockwise_triton(x, block, fmt=fmt, native_cast=True)
            assert torch.equal(fp8_bits(soft.data), fp8_bits(hard.data)), (fmt, block)


def test_the_gemm_bound_is_the_stated_one():
    """`GEMM_TOLERANCE` is what the GEMM bound tests here, in test_fp8_linear and in
    test_fp8_experts_triton hold each fast path to: Hopper accumulates FP8 products in ~14 bits
    inside a 128-wide K tile (DeepSeek-V3 report, section 3.3.2), 128 * 2**-14 = 2**-7 of
    ``|A| @ |B|``; the bf16 output rounds by 2**-8. A literal, so loosening it fails here."""
    assert dispatch.GEMM_TOLERANCE == {"REL": 2.0**-7, "OUT": 2.0**-8}


@pytest.mark.gpu
def test_fast_gemm_backends_within_stated_bound():
    """|out - ref64| <= REL * (|A| @ |B|.T) + OUT * |ref64| with A, B the dequantized operands."""
    from nemo_jetrl.fp8 import gemm_backends

    backends = _fast_gemm_backends()
    major, _ = torch.cuda.get_device_capability()
    if major == 9 and gemm_backends._cuda_at_least(12, 9):
        assert "scaled_mm" in backends, "SM90 with CUDA >= 12.9 must offer cuBLASLt blockwise"
    tol = dispatch.GEMM_TOLERANCE
    for pow2 in (True, False):
        a, b = _operands(m=300, n=512, k=1024, seed=3, device="cuda", pow2=pow2)
        a64, b64 = a.dequantize(torch.float64), b.dequantize(torch.float64)
        ref = a64 @ b64.t()
        bound = tol["REL"] * (a64.abs() @ b64.abs().t()) + tol["OUT"] * ref.abs()
        for name in backends:
            if name == "deep_gemm" and major == 10 and not pow2:
                continue  # SM100 DeepGEMM needs UE8M0 (power-of-two) scales: dispatch avoids it
            out = dispatch.fp8_gemm(a, b, backend=name).double()
            excess = float(((out - ref).abs() - bound).max())
            assert excess <= 0, f"{name} pow2={pow2}: exceeds bound by {excess}"
        assert dispatch.gemm_backend(a, b) in backends  # never the reference on a GPU
    # WGrad pair: dy and x quantized 128x1 along tokens, passed transposed (1x128 along tokens)
    if "scaled_mm" in backends:
        from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

        g = torch.Generator().manual_seed(4)
        dy = torch.randn(1024, 512, generator=g).to(torch.bfloat16).cuda()
        x = torch.randn(1024, 768, generator=g).to(torch.bfloat16).cuda()
        qa = quantize_blockwise_triton(dy, (128, 1), transpose=True)  # [512, 1024]
        qb = quantize_blockwise_triton(x, (128, 1), transpose=True)  # [768, 1024]
        a64, b64 = qa.dequantize(torch.float64), qb.dequantize(torch.float64)
        ref = a64 @ b64.t()
        bound = tol["REL"] * (a64.abs() @ b64.abs().t()) + tol["OUT"] * ref.abs()
        out = dispatch.fp8_gemm(qa, qb, backend="scaled_mm").double()
        assert float(((out - ref).abs() - bound).max()) <= 0
