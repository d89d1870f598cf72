"""The rehearsal's stand-in for vLLM's block-FP8 GEMM (rehearsal/vllm_block_fp8.py) against the
installed vLLM: it is vLLM's own kernel class with only the GEMM replaced, it is appended last
to this platform's registry and removed without a trace, and its GEMM is the block-dequantized
product (float64 reference, bound stated).
"""

from __future__ import annotations

import types

import pytest
import torch

pytestmark = pytest.mark.vllm


def test_registered_last_and_removed_exactly():
    from nemo_jetrl.backends.nemo_rl.rehearsal import vllm_block_fp8
    from nemo_jetrl.vllm_patch import compat

    reg = compat.fp8_block_registry()
    key = compat.current_platform_key()
    before = {k: list(v) for k, v in reg.items()}
    cls, undo = vllm_block_fp8.register()
    try:
        assert reg[key][-1] is cls and vllm_block_fp8.registered()
        assert cls.__name__ == vllm_block_fp8.CLASS_NAME  # what vLLM's "Selected" line names
        base, _ = compat.kernel_base_classes()
        assert issubclass(cls, base)
        # only the GEMM is ours: vLLM's quantizer, weight processing and apply_weights stay
        own = {n for n in vars(cls) if not n.startswith("_")}
        assert own == {"is_supported", "can_implement", "apply_block_scaled_mm"}, own
    finally:
        undo()
    assert {k: list(v) for k, v in reg.items()} == before
    assert not vllm_block_fp8.registered()


def test_its_gemm_is_the_block_dequantized_product():
    from nemo_jetrl.backends.nemo_rl.rehearsal import vllm_block_fp8

    cls = vllm_block_fp8.make_class()
    kernel = object.__new__(cls)  # the GEMM reads only config.out_dtype
    kernel.config = types.SimpleNamespace(out_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    m, n, k = 5, 256, 384
    a = (torch.randn(m, k, generator=g) * 50).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    a_s = torch.rand(m, k // 128, generator=g) + 0.5
    b_s = torch.rand(n // 128, k // 128, generator=g) + 0.5
    # vLLM's quantizer may hand the activation scales column-major: same values, other strides
    a_s_cm = a_s.t().contiguous().t()
    out = kernel.apply_block_scaled_mm(a, b, a_s_cm, b_s)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    a64 = a.double() * a_s.double().repeat_interleave(128, 1)
    b64 = b.double() * b_s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    ref = a64 @ b64.t()
    # fp32 accumulation then one BF16 rounding: within 2**-8 relative of the float64 product
    assert torch.allclose(out.double(), ref, rtol=2**-8, atol=1e-3 * ref.abs().max().item())
    # and a wrong scale layout (transposed) would not pass
    wrong = kernel.apply_block_scaled_mm(a, b, a_s, b_s.t().contiguous().t() * 2)
    assert not torch.allclose(wrong.double(), ref, rtol=2**-8)
