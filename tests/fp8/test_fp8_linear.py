"""Fp8BlockLinear (TE Float8BlockScaling emulation) and Fp8InferenceLinear (rollout twin)."""

from __future__ import annotations

import pytest
import torch
from linear_steps import quantize_as, run_step
from torch import nn

from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.inference_linear import Fp8InferenceLinear
from nemo_jetrl.fp8.linear import Fp8BlockLinear

U32 = 2.0**-24
CONFIGS = {
    "pow2": Fp8LinearConfig.te_blockwise(),
    "fp32": Fp8LinearConfig.te_blockwise_fp32_scales(),
    "hybrid-exact": Fp8LinearConfig.te_blockwise_hybrid(exact_gemm=True),
}


def _layer(k=256, n=384, dtype=torch.float32, seed=0, config=None):
    torch.manual_seed(seed)
    base = nn.Linear(k, n, dtype=dtype)
    return base, Fp8BlockLinear.from_linear(base, config or Fp8LinearConfig(), name="blk.fc1")


def _run(layer, shape=(3, 70, 256), seed=1):  # type: ignore[no-untyped-def]
    return run_step(layer, shape, seed)


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_forward_dgrad_wgrad_vs_float64_on_quantized_operands(key):
    cfg = CONFIGS[key]
    base, layer = _layer(config=cfg)
    x, y, dy = _run(layer)
    x2, dy2 = x.detach().reshape(-1, 256), dy.reshape(-1, 384)
    w, b = base.weight.detach(), base.bias.detach()
    gfmt = "e5m2" if cfg.fmt == "hybrid" else "e4m3"
    qx, qw = quantize_as(x2, (1, 128), cfg, "e4m3"), quantize_as(w, (128, 128), cfg, "e4m3")
    qdy, qdyc = quantize_as(dy2, (1, 128), cfg, gfmt), quantize_as(dy2, (128, 1), cfg, gfmt)
    qxc = quantize_as(x2, (128, 1), cfg, "e4m3")
    d = lambda q: q.dequantize(torch.float64)  # noqa: E731
    # forward: fp32 GEMM + bias, one bf16 rounding of the output
    ref = d(qx) @ d(qw).t() + b.double()
    bound = 256 * U32 * (d(qx).abs() @ d(qw).abs().t() + b.double().abs()) + 2.0**-8 * ref.abs()
    assert bool(((y.detach().reshape(-1, 384).double() - ref).abs() <= bound).all())
    # DGrad: the same W blocks, transposed; dX in bf16
    ref = d(qdy) @ d(qw)
    bound = 384 * U32 * (d(qdy).abs() @ d(qw).abs()) + 2.0**-8 * ref.abs()
    assert bool(((x.grad.reshape(-1, 256).double() - ref).abs() <= bound).all())
    # WGrad: dy and x each 128x1 along the 210 tokens; dW in the master's fp32
    ref = d(qdyc).t() @ d(qxc)
    bound = 210 * U32 * (d(qdyc).abs().t() @ d(qxc).abs())
    assert base.weight.grad.dtype == torch.float32
    assert bool(((base.weight.grad.double() - ref).abs() <= bound).all())
    assert torch.allclose(base.bias.grad, dy2.float().sum(0))


@pytest.mark.parametrize(
    ("key", "grad_bound"), [("pow2", 0.06), ("fp32", 0.06), ("hybrid-exact", 0.10)]
)
def test_relative_error_vs_bf16_linear(key, grad_bound):
    """Loose sanity bounds (relative Frobenius error; E4M3 has 3 mantissa bits, E5M2 has 2)."""
    base, layer = _layer(config=CONFIGS[key])
    x, y, dy = _run(layer)
    gx, gw = x.grad.clone(), base.weight.grad.clone()
    xr = x.detach().clone().requires_grad_(True)
    wr = base.weight.detach().bfloat16().requires_grad_(True)
    yr = nn.functional.linear(xr, wr, base.bias.detach().bfloat16())
    yr.backward(dy)

    def rel(a, b):
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).norm() / b.norm())

    assert rel(y, yr) < 0.06
    assert rel(gx, xr.grad) < grad_bound
    assert rel(gw, wr.grad) < grad_bound


def test_saved_tensors_are_fp8_and_scales_only():
    _, layer = _layer()
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    x = torch.randn(2, 128, 256, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    fp8 = [s for s in saved if s[0] == torch.float8_e4m3fn]
    # in the layout their backward GEMMs read: x 128x1 as [K, M], W as W.T [K, N]
    assert sorted(s[1] for s in fp8) == [(256, 256), (256, 384)]
    others = [s for s in saved if s[0] != torch.float8_e4m3fn]  # only the fp32 block scales
    assert sorted(others) == [(torch.float32, (2, 3)), (torch.float32, (256, 2))]


def test_hybrid_quantizes_gradients_to_e5m2(monkeypatch):
    import nemo_jetrl.fp8.linear as lin

    seen = []
    real = lin.quantize_blockwise

    def spy(t, block, **kw):
        seen.append((kw["name"].rsplit(".", 1)[-1], block, getattr(kw["fmt"], "name", kw["fmt"])))
        return real(t, block, **kw)

    def spy_pair(t, block, **kw):
        seen.append((kw["name"].rsplit(".", 1)[-1], block, getattr(kw["fmt"], "name", kw["fmt"])))
        return real_pair(t, block, **kw)

    real_pair = lin.quantize_with_transpose
    monkeypatch.setattr(lin, "quantize_blockwise", spy)
    monkeypatch.setattr(lin, "quantize_with_transpose", spy_pair)
    _, layer = _layer(config=Fp8LinearConfig.te_blockwise_hybrid())
    _run(layer)
    assert sorted(set(seen)) == [
        ("grad_output", (1, 128), "e5m2"),
        ("grad_output", (128, 1), "e5m2"),
        ("input", (1, 128), "e4m3"),
        ("input", (128, 1), "e4m3"),
        ("weight", (128, 128), "e4m3"),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_master_dtype_and_parameters_preserved(dtype):
    base, layer = _layer(dtype=dtype)
    assert layer.weight is base.weight and layer.bias is base.bias
    x, y, _ = _run(layer)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert base.weight.dtype == dtype and base.weight.grad.dtype == dtype
    assert base.bias.grad.dtype == dtype


def test_no_bias_and_frozen_weight_skip_wgrad():
    torch.manual_seed(0)
    layer = Fp8BlockLinear(128, 256, bias=False)
    layer.weight.requires_grad_(False)
    x, _, _ = _run(layer, shape=(5, 128))
    assert x.grad is not None and layer.weight.grad is None


def test_errors_name_the_layer():
    with pytest.raises(ValueError, match=r"blk\.odd: in_features=100 is not a multiple of 16"):
        Fp8BlockLinear(100, 128, name="blk.odd")
    _, layer = _layer()
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    x[2, 7] = float("nan")
    with pytest.raises(ValueError, match=r"blk\.fc1\.input.*\[2, 7\]"):
        layer(x)


@pytest.mark.parametrize("key", sorted(CONFIGS))
@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16])
def test_inference_linear_equals_training_forward_bitwise(key, master):
    """The on-policy promise at layer level: rollout forward == training forward, bit for bit."""
    cfg = CONFIGS[key]
    base, train = _layer(dtype=master, config=cfg)
    infer = Fp8InferenceLinear.from_linear(base, cfg, name="blk.fc1")
    x = torch.randn(2, 33, 256).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(infer(x).view(torch.int16), train(x).view(torch.int16))
    # trainer-quantized weights load without requantization: same bits again
    qw = quantize_blockwise(base.weight.detach(), (128, 128), pow2_scales=cfg.pow2_scales)
    infer2 = Fp8InferenceLinear(256, 384, config=cfg, bias_dtype=master)
    infer2.load_quantized(fp8_bits(qw.data), qw.scale_inv, base.bias.detach())
    with torch.no_grad():
        assert torch.equal(infer2(x).view(torch.int16), train(x).view(torch.int16))


def test_vllm_native_quantizer_is_off_policy_with_fp32_scales_only():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 256, generator=g) * torch.logspace(-1, 2, 256)).to(torch.bfloat16)
    for cfg, same in ((Fp8LinearConfig.te_blockwise(), True), (Fp8LinearConfig.te_blockwise_fp32_scales(), False)):  # fmt: skip
        base, train = _layer(config=cfg)
        native = Fp8InferenceLinear.from_linear(base, cfg, quantizer="vllm_native")
        with torch.no_grad():
            assert torch.equal(native(x), train(x)) is same


def test_inference_linear_input_errors():
    layer = Fp8InferenceLinear(128, 128, name="blk.o_proj")
    with pytest.raises(RuntimeError, match="no weight loaded"):
        layer(torch.zeros(1, 128))
    with pytest.raises(ValueError, match=r"blk\.o_proj: weight shape"):
        layer.load_weight(torch.zeros(128, 256))
    with pytest.raises(ValueError, match="scale_inv"):
        layer.load_quantized(torch.zeros(128, 128, dtype=torch.uint8), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="quantizer"):
        Fp8InferenceLinear(128, 128, quantizer="te")  # type: ignore[arg-type]


def test_inference_linear_is_built_on_its_linears_device(monkeypatch):
    """H200 run 8: ``from_linear`` of a CUDA linear built CPU buffers, and the first forward
    failed inside Triton's launcher ("Pointer argument (at 1) cannot be accessed from Triton (cpu
    tensor?)"). The layer now lives where the linear does (the meta device stands in for CUDA
    here: nothing is quantized on it), and a forward on another device names the layer."""
    layer = Fp8InferenceLinear(128, 256, name="blk.qkv", device="meta")
    assert {b.device.type for b in layer.buffers()} == {"meta"}
    loaded = []
    monkeypatch.setattr(Fp8InferenceLinear, "load_weight", lambda self, w, b=None: loaded.append(w))
    meta = Fp8InferenceLinear.from_linear(nn.Linear(128, 256, device="meta"), name="blk.qkv")
    assert {b.device.type for b in meta.buffers()} == {"meta"} and loaded[0].is_meta
    monkeypatch.undo()
    cpu = Fp8InferenceLinear.from_linear(nn.Linear(128, 256, dtype=torch.bfloat16), name="blk.o")
    assert {b.device.type for b in cpu.buffers()} == {"cpu"}
    with pytest.raises(ValueError, match=r"blk\.o: input on meta, weight on cpu; move the layer"):
        cpu(torch.zeros(3, 128, dtype=torch.bfloat16, device="meta"))


def test_config_validation_collects_errors():
    with pytest.raises(ValueError, match=r"fmt='e5m2'.*eps=-1"):
        Fp8LinearConfig(fmt="e5m2", eps=-1)
    cfg = Fp8LinearConfig.te_blockwise_hybrid()
    assert cfg.grad_format.name == "e5m2" and cfg.forward_format.name == "e4m3"
    assert Fp8LinearConfig.te_blockwise_fp32_scales().pow2_scales is False
    with pytest.raises(AttributeError):
        cfg.fmt = "e4m3"  # type: ignore[misc]


def _grads_bits(layer, seed=1):
    x, y, _ = _run(layer, seed=seed)
    out = [y, x.grad, layer.weight.grad]
    if layer.bias is not None:
        out.append(layer.bias.grad)
    return [fp8_bits(t) if t.dtype.itemsize == 1 else t.detach().clone() for t in out]


def test_cpu_gemms_stay_the_reference_whatever_the_gemm_backend_env(monkeypatch):
    """On CPU the layer never consults the GEMM dispatch: a forced fast backend changes nothing."""
    _, layer = _layer(config=CONFIGS["hybrid-exact"])
    before = _grads_bits(layer)
    layer.weight.grad = layer.bias.grad = None
    monkeypatch.setenv("JETRL_FP8_GEMM_BACKEND", "scaled_mm")  # would raise if consulted on CPU
    after = _grads_bits(layer)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("bias", [True, False])
def test_cuda_path_sends_all_three_gemms_through_dispatch(monkeypatch, bias):
    """With operands treated as CUDA, FProp/DGrad/WGrad call dispatch.fp8_gemm with the right
    operand pairs and output dtypes; fp8_gemm's reference backend then gives the CPU bits."""
    from nemo_jetrl.fp8 import dispatch, linear

    torch.manual_seed(0)
    base = nn.Linear(256, 384, bias=bias, dtype=torch.float32)
    cfg = CONFIGS["pow2"]
    layer = Fp8BlockLinear.from_linear(base, cfg, name="blk.fc1")
    before = _grads_bits(layer)
    layer.weight.grad = None
    if bias:
        layer.bias.grad = None
    calls = []

    def recording_gemm(a, b, *, out_dtype, exact=False, **kw):
        calls.append((a.block, b.block, a.fmt, out_dtype, exact))
        return dispatch.fp8_gemm(a, b, out_dtype=out_dtype, exact=exact, **kw)

    monkeypatch.setattr(linear, "_on_gpu", lambda a: True)
    monkeypatch.setattr(linear, "fp8_gemm", recording_gemm)
    after = _grads_bits(layer)
    assert calls == [
        ((1, 128), (128, 128), "e4m3", torch.float32 if bias else torch.bfloat16, False),  # FProp
        ((1, 128), (128, 128), "e4m3", torch.bfloat16, False),  # DGrad: dy x W (W.T's blocks)
        ((1, 128), (1, 128), "e4m3", torch.float32, False),  # WGrad: dy.T x x.T, fp32 master
    ]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [True, False])
def test_cuda_rollout_rows_equal_the_training_forward_at_every_batch_size(pow2):
    """Issue 47 per op on a GPU: the local backend's rollout linear gives a token's row the bits
    the trainer's forward gives it, whether the token is a decode step (M = 1), in a small batch
    or in a 2048-token prefill, as the backend configures both sides (``exact_gemm``, which on a
    CPU picks the reference's exact per-tile sums: with one fp32 matmul a CPU's rows differ with
    M, checked; on a GPU both sides run the planned kernel, whose rows cuBLASLt kept independent
    of M at K < 12288 in both scale modes, benchmarks/gpu/results h100_run6)."""
    cfg = Fp8LinearConfig(pow2_scales=pow2, exact_gemm=True)
    torch.manual_seed(0)
    base = nn.Linear(1024, 768, bias=True, dtype=torch.bfloat16).cuda()
    train = Fp8BlockLinear.from_linear(base, cfg, name="blk.qkv")
    infer = Fp8InferenceLinear.from_linear(base, cfg, name="blk.qkv")
    x = torch.randn(2048, 1024, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        full = train(x).view(torch.int16)
        for rows in (slice(0, 1), slice(5, 6), slice(0, 3), slice(64, 128), slice(0, 2048)):
            assert torch.equal(infer(x[rows]).view(torch.int16), full[rows]), (pow2, rows)


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_linear_within_gemm_bound_of_float64(bias):
    """On a GPU the layer's FProp (dispatched GEMM) stays within dispatch.GEMM_TOLERANCE of the
    float64 product of the same FP8 operands, plus the bias."""
    from nemo_jetrl.fp8 import dispatch

    torch.manual_seed(0)
    base = nn.Linear(1024, 512, bias=bias, dtype=torch.bfloat16).cuda()
    cfg = CONFIGS["pow2"]
    layer = Fp8BlockLinear.from_linear(base, cfg, name="blk.fc1")
    x = torch.randn(300, 1024, device="cuda").to(torch.bfloat16)
    y = layer(x).double()
    a64 = quantize_as(x, (1, 128), cfg, "e4m3").dequantize(torch.float64)
    b64 = quantize_as(layer.weight.detach(), (128, 128), cfg, "e4m3").dequantize(torch.float64)
    ref = a64 @ b64.t() + (layer.bias.double() if bias else 0.0)
    tol = dispatch.GEMM_TOLERANCE
    bound = tol["REL"] * (a64.abs() @ b64.abs().t()) + tol["OUT"] * ref.abs()
    assert float(((y - ref).abs() - bound).max()) <= 0
