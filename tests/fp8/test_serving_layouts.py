"""The layouts the vLLM serving kernel hands its GEMMs (`gemm_layouts.activation_layout`,
`gemm_ready_weight_scales`) and the Triton quantizer writing into caller-given, row-padded
buffers (``quantize_blockwise_triton(out=...)``). Triton under the CPU interpreter."""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.fp8 import fp8_bits, gemm_layouts, quantize_blockwise, triton_kernels

TRITON = triton_kernels.can_run(torch.zeros(1, dtype=torch.bfloat16))


@pytest.mark.skipif(not TRITON, reason="needs triton (its interpreter on CPU)")
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize(("m", "rows"), [(1, 4), (5, 8), (37, 40), (8, 8)])
def test_quantizer_writes_padded_caller_buffers_with_zero_rows(m, rows, pow2):
    """Rows < M: the reference's codes and scales, in an MN-major scale view; rows M..R-1: zero
    codes and scale 1 (written by the same launch, deterministic)."""
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 300, generator=g) * 5).bfloat16()  # K = 300: a partial last block
    kb = 3
    data = torch.full((rows, 300), 7.0).to(torch.float8_e4m3fn)  # stale values to overwrite
    scale = torch.full((kb, rows), -5.0)[:, :rows].t()
    q = triton_kernels.quantize_blockwise_triton(
        x, (1, 128), pow2_scales=pow2, check_finite=False, out=(data, scale)
    )
    assert q.data is data and q.scale_inv is scale
    ref = quantize_blockwise(x, (1, 128), pow2_scales=pow2)
    assert torch.equal(fp8_bits(data[:m]), fp8_bits(ref.data))
    assert torch.equal(scale[:m], ref.scale_inv)
    assert not fp8_bits(data[m:]).any() and torch.equal(scale[m:], torch.ones(rows - m, kb))


@pytest.mark.skipif(not TRITON, reason="needs triton (its interpreter on CPU)")
def test_quantizer_refuses_out_buffers_that_do_not_fit_naming_the_tensor():
    x = torch.randn(5, 256).bfloat16()
    good_s = torch.empty(8, 2)
    with pytest.raises(ValueError, match=r"tensor 'act'.*out data must be an \[R >= 5, 256\]"):
        triton_kernels.quantize_blockwise_triton(
            x, (1, 128), name="act", out=(torch.empty(4, 256, dtype=torch.float8_e4m3fn), good_s)
        )
    with pytest.raises(ValueError, match=r"out scale_inv must be a \[8, 2\] float32"):
        data = torch.empty(8, 256, dtype=torch.float8_e4m3fn)
        triton_kernels.quantize_blockwise_triton(x, (1, 128), out=(data, torch.empty(5, 2)))
    with pytest.raises(ValueError, match="out= is for 2-D 1x128"):
        triton_kernels.quantize_blockwise_triton(
            x, (128, 128), out=(torch.empty(8, 256, dtype=torch.float8_e4m3fn), good_s)
        )


@pytest.mark.parametrize("backend", ["scaled_mm", "deep_gemm", "triton", "reference"])
def test_activation_layout_rows_are_ones_the_backend_takes_at_every_m(backend):
    """The serving kernel pads M to `row_multiple`, so `shape_problem` never moves its GEMM."""
    rows, layout = gemm_layouts.activation_layout(backend)
    assert layout == ("compact" if backend == "reference" else "mn_major")
    for m in range(1, 70):
        padded = -(-m // rows) * rows
        assert gemm_layouts.shape_problem(backend, padded, 4096, 4096) is None, (backend, m)
    if backend == "scaled_mm":
        assert gemm_layouts.shape_problem(backend, 37, 4096, 4096) is not None


@pytest.mark.parametrize("kb", [1, 3, 4, 5, 32])
def test_stored_weight_scales_are_cublaslt_scale_b_as_a_view(kb):
    """`gemm_ready_weight_scales("scaled_mm")` holds the values in a [N/128, pad4(kb)] array
    whose transpose view is cuBLASLt's ``scale_b`` ([pad4(kb), N/128], strides (1, pad4(kb)));
    `padded_storage` finds it again with no copy; compact scales with kb % 4 != 0 are not it."""
    s = torch.rand(6, kb) + 0.5
    ready = gemm_layouts.gemm_ready_weight_scales("scaled_mm", s)
    kb4 = -(-kb // 4) * 4
    scale_b = gemm_layouts.padded_storage(ready)
    assert scale_b is not None and tuple(scale_b.shape) == (kb4, 6)
    assert scale_b.stride() == (1, kb4) and scale_b.data_ptr() == ready.data_ptr()
    assert torch.equal(scale_b[:kb].t(), s) and not scale_b[kb:].any()
    assert (gemm_layouts.padded_storage(s) is None) == (kb % 4 != 0)
