"""Our block-FP8 kernel as a vLLM kernel class, without an engine (fast; needs vLLM).

The engine test (test_vllm_engine.py) runs power-of-two scales end to end; this one covers the
FP32-scale mode and the kernel's contract with vLLM's selector directly on vLLM's own config and
quant-key types. How the kernel runs its GEMM (backends, host reads, CUDA graphs):
test_vllm_kernel_backends.py.
"""

from __future__ import annotations

import collections
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
