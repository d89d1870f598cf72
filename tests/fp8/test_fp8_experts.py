"""Grouped FP8 expert linear (issue 27): per expert bit for bit the dense FP8 linear.

Every expert's FProp rows, DGrad rows and weight gradient are compared with
`Fp8BlockLinearFunction` applied to that expert's rows and weight alone, under each recipe
format, scale mode, GEMM mode and master dtype, with experts of 0, 1, 127, 128 and 129 tokens.
Runs whatever `grouped_backend` picks for the device (the reference on CPU).
"""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.fp8 import finite_flags, fp8_bits, gemm_backends
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.experts import (
    grouped_fp8_linear,
    grouped_fp8_linear_inference,
    load_expert_weights,
    quantize_expert_weights,
)
from nemo_jetrl.fp8.inference_linear import Fp8InferenceLinear
from nemo_jetrl.fp8.linear import Fp8BlockLinearFunction

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
COUNTS = [129, 0, 1, 127, 128]  # tokens per expert (M = 385); expert 1 gets none
CONFIGS = {
    "pow2": Fp8LinearConfig.te_blockwise(),
    "fp32_scales": Fp8LinearConfig.te_blockwise_fp32_scales(),
    "hybrid": Fp8LinearConfig.te_blockwise_hybrid(),
}


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device=DEVICE)


def _data(counts, n=256, k=128, master=torch.float32, seed=0):
    """x with a different magnitude per expert (so blocks spanning two experts would show),
    the stacked weight, and an output gradient."""
    g = torch.Generator().manual_seed(seed)
    m, e = sum(counts), len(counts)
    mag = torch.cat([torch.full((c, 1), 1.7**i) for i, c in enumerate(counts)])
    x = (torch.randn(m, k, generator=g) * mag).to(torch.bfloat16)
    w = (torch.randn(e, n, k, generator=g) * 0.05).to(master)
    dy = (torch.randn(m, n, generator=g) * mag * 1e-2).to(torch.bfloat16)
    return x.to(DEVICE), w.to(DEVICE), dy.to(DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bits (so -0.0 vs +0.0 and NaN payloads count)."""
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _grouped(x, w, dy, offsets, config):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = grouped_fp8_linear(x, w, offsets, config, "moe")
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _dense(x, w, dy, config):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = Fp8BlockLinearFunction.apply(x, w, None, config, "dense")
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("exact", [False, True], ids=["fast_gemm", "exact_gemm"])
@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_every_expert_equals_the_dense_layer_bit_for_bit(key, master, exact, monkeypatch):
    if DEVICE == "cuda":
        # One GEMM kernel on both sides: the grouped layer's Triton kernels against the dense
        # layer's (cuBLASLt accumulates differently from a Triton FP8 dot on Hopper).
        monkeypatch.setenv(gemm_backends.ENV_GEMM_BACKEND, "triton")
    config = Fp8LinearConfig(**{**CONFIGS[key].__dict__, "exact_gemm": exact})
    x, w, dy = _data(COUNTS, master=master)
    offsets = _offsets(COUNTS)
    y, dx, dw = _grouped(x, w, dy, offsets, config)
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == master
    assert y.shape == (sum(COUNTS), 256) and dw.shape == w.shape
    off = offsets.tolist()
    for e, count in enumerate(COUNTS):
        rows = slice(off[e], off[e + 1])
        if count == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e])), "no token: zero gradient"
            continue
        want = _dense(x[rows], w[e], dy[rows], config)
        for label, got, ref in zip(
            ("y", "dx", "dW"), (y[rows], dx[rows], dw[e]), want, strict=True
        ):
            assert torch.equal(_bits(got), _bits(ref)), f"expert {e} ({count} tokens): {label}"
    assert bool(dw.abs().sum() > 0) and bool(dx.abs().sum() > 0)


def test_wgrad_blocks_start_at_each_experts_first_token():
    """Blocks over the whole sorted batch would mix experts 0 and 1 (129 + 127 tokens): expert
    1's weight gradient would then depend on expert 0's tokens. It must not."""
    config = Fp8LinearConfig.te_blockwise_fp32_scales()
    counts = [129, 127]
    x, w, dy = _data(counts, seed=3)
    _, _, dw = _grouped(x, w, dy, _offsets(counts), config)
    x2 = x.clone()
    x2[:129] *= 3.0  # only expert 0's tokens change
    dy2 = dy.clone()
    dy2[:129] *= 5.0
    _, _, dw2 = _grouped(x2, w, dy2, _offsets(counts), config)
    assert torch.equal(_bits(dw[1]), _bits(dw2[1]))
    assert not torch.equal(_bits(dw[0]), _bits(dw2[0]))


def test_token_order_inside_an_expert_only_permutes_fprop_and_dgrad_rows():
    config = Fp8LinearConfig.te_blockwise()
    counts = [40, 90]
    x, w, dy = _data(counts, seed=4)
    offsets = _offsets(counts)
    perm = torch.cat([torch.randperm(40), 40 + torch.randperm(90)]).to(DEVICE)
    y, dx, _ = _grouped(x, w, dy, offsets, config)
    yp, dxp, _ = _grouped(x[perm], w, dy[perm], offsets, config)
    assert torch.equal(_bits(y[perm]), _bits(yp)) and torch.equal(_bits(dx[perm]), _bits(dxp))


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_inference_twin_gives_the_training_forward_bits(key):
    config = CONFIGS[key]
    x, w, _ = _data(COUNTS, seed=5)
    offsets = _offsets(COUNTS)
    qw = quantize_expert_weights(w, config, "moe")
    assert qw.data.dtype == torch.float8_e4m3fn and qw.scale_inv.shape == (5, 2, 1)
    with torch.no_grad():
        want = grouped_fp8_linear(x, w, offsets, config, "moe")
    got = grouped_fp8_linear_inference(x, qw, offsets, config, "moe")
    assert torch.equal(_bits(got), _bits(want))
    # each expert's bytes are what the dense rollout layer stores for that weight
    for e in range(5):
        layer = Fp8InferenceLinear(128, 256, bias=False, config=config, name=f"e{e}")
        layer.load_weight(w[e].cpu())
        assert torch.equal(fp8_bits(qw.data[e].cpu()), fp8_bits(layer.weight_fp8))
        assert torch.equal(_bits(qw.scale_inv[e]), _bits(layer.weight_scale_inv))


def test_inference_bias_is_each_experts_fp32_epilogue(monkeypatch):
    # On a GPU against the dense layer on the same GPU and GEMM kernel (Triton): tensor-core
    # dots of random values do not round as the CPU reference's sums do (seen on an H100).
    dev = DEVICE
    if dev == "cuda":
        monkeypatch.setenv(gemm_backends.ENV_GEMM_BACKEND, "triton")
    config = Fp8LinearConfig.te_blockwise_fp32_scales()
    x, w, _ = _data(COUNTS, seed=6)
    bias = (torch.randn(5, 256, generator=torch.Generator().manual_seed(7)) * 3).to(DEVICE)
    offsets = _offsets(COUNTS)
    got = grouped_fp8_linear_inference(
        x, quantize_expert_weights(w, config), offsets, config, "moe", bias=bias
    )
    off = offsets.tolist()
    for e in range(5):
        layer = Fp8InferenceLinear(128, 256, bias=True, config=config, bias_dtype=torch.float32)
        layer.load_weight(w[e].cpu(), bias[e].cpu())
        want = layer.to(dev)(x[off[e] : off[e + 1]].to(dev))
        assert torch.equal(_bits(got[off[e] : off[e + 1]]), _bits(want)), f"expert {e}"


def test_non_finite_input_weight_and_gradient_are_named_by_expert():
    if finite_flags.sync_free(torch.zeros(1, device=DEVICE)):
        pytest.skip("CUDA defers the check (see test_deferred_flags_name_the_expert)")
    config = Fp8LinearConfig.te_blockwise()
    x, w, dy = _data(COUNTS, seed=8)
    offsets = _offsets(COUNTS)
    bad = x.clone()
    bad[257 + 3, 5] = float("nan")  # expert 4's 4th token (offsets 0,129,129,130,257)
    with pytest.raises(ValueError, match=r"'moe\.expert4\.input'"):
        grouped_fp8_linear(bad, w, offsets, config, "moe")
    bad_w = w.clone()
    bad_w[2, 7, 1] = float("inf")
    with pytest.raises(ValueError, match=r"'moe\.expert2\.weight'"):
        grouped_fp8_linear(x, bad_w, offsets, config, "moe")
    with pytest.raises(ValueError, match=r"'moe\.expert2\.weight'"):
        quantize_expert_weights(bad_w, config, "moe")
    bad_dy = dy.clone()
    bad_dy[0, 0] = float("nan")
    xr = x.clone().requires_grad_(True)
    y = grouped_fp8_linear(xr, w, offsets, config, "moe")
    with pytest.raises(ValueError, match=r"'moe\.expert0\.grad_output'"):
        y.backward(bad_dy)


def test_deferred_flags_name_the_expert(monkeypatch):
    """The CUDA behaviour (no host read; flags per expert) on any device."""
    monkeypatch.setattr(finite_flags, "sync_free", lambda t: True)
    finite_flags._FLAGS.clear()
    config = Fp8LinearConfig.te_blockwise()
    x, w, _ = _data(COUNTS, seed=9)
    x[130, 0] = float("nan")  # expert 3 (offsets 0,129,129,130,257)
    w[0, 0, 0] = float("nan")
    y = grouped_fp8_linear(x, w, _offsets(COUNTS), config, "moe")
    assert bool(torch.isnan(y[130]).any())
    with pytest.raises(ValueError, match=r"\['moe\.expert3\.input', 'moe\.expert0\.weight'\]"):
        finite_flags.check_non_finite()
    assert finite_flags.pending() == 0


def test_offsets_that_do_not_cover_the_batch_are_refused():
    if finite_flags.sync_free(torch.zeros(1, device=DEVICE)):
        pytest.skip("offsets values are not read on CUDA")
    config = Fp8LinearConfig.te_blockwise()
    x, w, _ = _data([3, 4], seed=10)
    for off in ([0, 3, 6], [1, 3, 7], [0, 5, 4, 7][:3]):
        with pytest.raises(ValueError, match="offsets"):
            grouped_fp8_linear(x, w, torch.tensor(off, device=DEVICE), config, "moe")
    with pytest.raises(ValueError, match="int64"):
        grouped_fp8_linear(x, w, torch.tensor([0, 3, 7], dtype=torch.int32), config, "moe")
    with pytest.raises(ValueError, match="multiples of 128"):
        grouped_fp8_linear(x[:, :100], w[:, :, :100], _offsets([3, 4]), config, "moe")


def test_trainer_bytes_load_unchanged_and_bad_ones_are_refused_naming_the_expert():
    config = Fp8LinearConfig.te_blockwise()
    x, w, _ = _data(COUNTS, seed=11)
    offsets = _offsets(COUNTS)
    qw = quantize_expert_weights(w, config, "moe")
    loaded = load_expert_weights(fp8_bits(qw.data), qw.scale_inv, config, "moe")  # uint8 bits
    assert loaded.data.dtype == torch.float8_e4m3fn and torch.equal(
        _bits(loaded.data), _bits(qw.data)
    )
    got = grouped_fp8_linear_inference(x, loaded, offsets, config, "moe")
    assert torch.equal(
        _bits(got), _bits(grouped_fp8_linear_inference(x, qw, offsets, config, "moe"))
    )
    nan_byte = fp8_bits(qw.data).clone()
    nan_byte[2, 17, 5] = 0x7F  # E4M3FN NaN
    with pytest.raises(ValueError, match=r"moe\.expert2\.weight: 1 FP8 byte"):
        load_expert_weights(nan_byte, qw.scale_inv, config, "moe")
    bad_scale = qw.scale_inv.clone()
    bad_scale[4, 1, 0] = 0.0
    with pytest.raises(ValueError, match=r"moe\.expert4\.weight: scale_inv"):
        load_expert_weights(qw.data, bad_scale, config, "moe")
    with pytest.raises(ValueError, match=r"\[E, N/128, K/128\]"):
        load_expert_weights(qw.data, qw.scale_inv[:, :1], config, "moe")
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        load_expert_weights(qw.data.view(torch.int8), qw.scale_inv, config, "moe")


def test_exact_gemm_rows_do_not_depend_on_the_rest_of_the_batch():
    """exact_gemm=True is order-free: a rollout batch of a few tokens gives each token the bits
    it gets inside the training batch (other experts' counts, tile positions all differ)."""
    config = Fp8LinearConfig.te_blockwise_fp32_scales(exact_gemm=True)
    x, w, _ = _data(COUNTS, seed=12)
    offsets = _offsets(COUNTS)  # 0, 129, 129, 130, 257, 385
    qw = quantize_expert_weights(w, config, "moe")
    full = grouped_fp8_linear_inference(x, qw, offsets, config, "moe")
    rows = torch.tensor([3, 77, 128, 129, 200, 256, 300], device=DEVICE)
    sub = grouped_fp8_linear_inference(x[rows], qw, _offsets([3, 0, 1, 2, 1]), config, "moe")
    assert torch.equal(_bits(sub), _bits(full[rows]))
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        grouped_fp8_linear(x, w[0], _offsets([385]), config, "moe")


def test_group_flags_of_another_size_widen_and_keep_each_group(monkeypatch):
    """A flag left pending with 5 groups (a step that failed before check_non_finite) and a
    layer recording 6 under the same name: group i stays group i (on the first H100 run this
    was a size-mismatch crash in every later test)."""
    monkeypatch.setattr(finite_flags, "_FLAGS", {})
    name = "moe_w.expert{}.input"
    finite_flags.record_each(name, torch.tensor([False, True, False, False, False]))
    finite_flags.record_each(name, torch.tensor([False] * 5 + [True]))
    finite_flags.record_each(name, torch.tensor([True, False]))
    with pytest.raises(ValueError, match=r"\['moe_w.expert0.input', 'moe_w.expert1.input', "
                       r"'moe_w.expert5.input'\]"):  # fmt: skip
        finite_flags.check_non_finite()
    assert finite_flags.pending() == 0
