"""Linears whose dims are not multiples of 128 run blockwise FP8 (issue 39): partial blocks.

Shapes: Moonlight's ``kv_a_proj_with_mqa`` (2048 -> 576: a 64-row tail block), Qwen3.5's
``in_proj_a/b`` (4096 -> 32: one 32-row block; K cut to 1024 here for time) and 304 -> 200
(tails in both dims), over 77 tokens (a 77-token WGrad block). The rule is TE's FP8 GEMM rule
(`spec.linear_dims_problem`: in % 16, out % 8); the GEMM backends route a shape they cannot take
(cuBLASLt: M % 4, N % 16, K % 16; DeepGEMM: N % 64, K % 128) to Triton.
"""

from __future__ import annotations

import linear_steps
import pytest
import torch
from linear_steps import quantize_as, run_step
from torch import nn

from nemo_jetrl.fp8 import (
    BlockQuantized,
    finite_flags,
    fp8_bits,
    gemm_backends,
    gemm_layouts,
    quantize_blockwise,
)
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.convert import convert_to_fp8_inference, convert_to_fp8_training
from nemo_jetrl.fp8.gemm import blockwise_matmul
from nemo_jetrl.fp8.inference_linear import Fp8InferenceLinear
from nemo_jetrl.fp8.linear import Fp8BlockLinear, check_expert_dims, check_fp8_dims
from nemo_jetrl.fp8.spec import linear_dims_problem

U32 = 2.0**-24
SHAPES = {"kv_a_proj_with_mqa": (2048, 576), "in_proj_a": (1024, 32), "both_tails": (304, 200)}
CONFIGS = {
    "pow2": Fp8LinearConfig.te_blockwise(),
    "fp32": Fp8LinearConfig.te_blockwise_fp32_scales(),
    "hybrid-exact": Fp8LinearConfig.te_blockwise_hybrid(exact_gemm=True),
}
TOKENS = (7, 11)  # 77 tokens

cuda_path = linear_steps.cuda_path  # the shared fixture (tests/fp8/linear_steps.py)


def _layer(k, n, config, seed=0):
    torch.manual_seed(seed)
    base = nn.Linear(k, n, dtype=torch.float32)
    return base, Fp8BlockLinear.from_linear(base, config, name="blk.kv_a")


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_forward_dgrad_wgrad_vs_float64(shape, key):
    """Each GEMM within ``K * 2**-24 * |A||B|`` (+ one bf16 rounding) of the float64 product of
    the dequantized FP8 operands, quantized with partial blocks by `quantize_blockwise`."""
    cfg, (k, n) = CONFIGS[key], SHAPES[shape]
    base, layer = _layer(k, n, cfg)
    x, y, dy = run_step(layer, (*TOKENS, k))
    m = TOKENS[0] * TOKENS[1]
    x2, dy2 = x.detach().reshape(m, k), dy.reshape(m, n)
    w, b = base.weight.detach(), base.bias.detach()
    gfmt = "e5m2" if cfg.fmt == "hybrid" else "e4m3"
    qx, qw = quantize_as(x2, (1, 128), cfg, "e4m3"), quantize_as(w, (128, 128), cfg, "e4m3")
    assert qw.scale_inv.shape == (-(-n // 128), -(-k // 128))  # ceil-sized grid
    qdy, qdyc, qxc = (
        quantize_as(dy2, (1, 128), cfg, gfmt),
        quantize_as(dy2, (128, 1), cfg, gfmt),
        quantize_as(x2, (128, 1), cfg, "e4m3"),
    )
    d = lambda q: q.dequantize(torch.float64)  # noqa: E731
    ref = d(qx) @ d(qw).t() + b.double()
    bound = k * U32 * (d(qx).abs() @ d(qw).abs().t() + b.double().abs()) + 2.0**-8 * ref.abs()
    assert bool(((y.detach().reshape(m, n).double() - ref).abs() <= bound).all()), "FProp"
    ref = d(qdy) @ d(qw)
    bound = n * U32 * (d(qdy).abs() @ d(qw).abs()) + 2.0**-8 * ref.abs()
    assert bool(((x.grad.reshape(m, k).double() - ref).abs() <= bound).all()), "DGrad"
    ref = d(qdyc).t() @ d(qxc)
    bound = m * U32 * (d(qdyc).abs().t() @ d(qxc).abs())
    assert bool(((base.weight.grad.double() - ref).abs() <= bound).all()), "WGrad"
    assert torch.allclose(base.bias.grad, dy2.float().sum(0))
    # and FP8 still means something here: close to the bf16 layer (loose, E4M3 has 3 bits)
    yr = nn.functional.linear(x.detach(), w.bfloat16(), b.bfloat16()).float()
    assert float((y.detach().float() - yr).norm() / yr.norm()) < 0.06


def test_weight_operand_bits_are_the_quantizers():
    """The layer's cached FP8 weight is `quantize_blockwise`'s 128x128 quantization, tail block
    included (the on-policy promise: the rollout quantizes the same weight to the same bits)."""
    cfg = CONFIGS["pow2"]
    base, layer = _layer(2048, 576, cfg)
    run_step(layer, (*TOKENS, 2048))
    cached = layer.fp8_state.cache.lookup(layer.weight, pair=False)
    assert cached is not None
    want = quantize_as(base.weight.detach(), (128, 128), cfg, "e4m3")
    assert torch.equal(fp8_bits(cached[0].data), fp8_bits(want.data))
    assert torch.equal(cached[0].scale_inv, want.scale_inv) and want.scale_inv.shape == (5, 16)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_rollout_twin_gives_the_trainers_forward_bits(shape):
    cfg, (k, n) = CONFIGS["pow2"], SHAPES[shape]
    base, layer = _layer(k, n, cfg)
    inf = Fp8InferenceLinear.from_linear(base, cfg, name="blk.kv_a")
    assert inf.weight_scale_inv.shape == (-(-n // 128), -(-k // 128))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(77, k, generator=g).bfloat16()
    with torch.no_grad():
        want = layer(x)
    assert torch.equal(inf(x).view(torch.int16), want.view(torch.int16))


def test_dims_rule_is_tes_and_names_the_layer():
    for k, n in [*SHAPES.values(), (4096, 32), (7168, 576), (128, 8)]:
        assert linear_dims_problem(k, n) is None
        check_fp8_dims(k, n, "blk")
    with pytest.raises(ValueError, match=r"blk\.odd: in_features=100 is not a multiple of 16"):
        Fp8BlockLinear(100, 128, name="blk.odd")
    with pytest.raises(ValueError, match=r"out_features=36 is not a multiple of 8"):
        check_fp8_dims(128, 36, "blk.odd")
    with pytest.raises(ValueError, match="multiples of 128"):  # fused experts keep the old rule
        check_expert_dims(2048, 576, "experts")


def test_convert_takes_partial_blocks_and_keeps_what_te_refuses():
    torch.manual_seed(0)
    for convert in (convert_to_fp8_training, convert_to_fp8_inference):
        model = nn.Sequential(nn.Linear(2048, 576), nn.Linear(576, 32), nn.Linear(32, 100))
        report = convert(model)
        assert report.converted == ("0", "1")
        assert "out_features=100 is not a multiple of 8" in report.kept["2"]


# ----------------------------------------------------------------------- GEMM routing


def test_shape_problem_rules():
    sp = gemm_layouts.shape_problem
    assert sp("deep_gemm", 77, 576, 2048) is None  # FProp 2048 -> 576 (576 % 64 == 0)
    assert "K % 128" in sp("deep_gemm", 77, 2048, 576)  # its DGrad: K = 576
    assert sp("deep_gemm", 77, 32, 4096) is not None  # N = 32
    assert sp("scaled_mm", 76, 576, 2048) is None and sp("scaled_mm", 76, 2048, 576) is None
    assert sp("scaled_mm", 76, 200, 304) is not None  # N = 200
    assert sp("triton", 77, 200, 304) is None and sp("reference", 77, 200, 304) is None


@pytest.mark.parametrize("planned", ["deep_gemm", "scaled_mm"])
def test_run_gemm_routes_a_refused_shape_to_triton(planned, monkeypatch):
    """FAKE runners (labelled: DeepGEMM and cuBLASLt need a GPU): record who was asked."""
    calls = []
    for name in ("deep_gemm", "scaled_mm", "triton"):
        monkeypatch.setitem(gemm_backends.RUNNERS, name, lambda a, b, o, _n=name: calls.append(_n))
    monkeypatch.setattr(
        gemm_backends, "device_caps", lambda d: gemm_backends.DeviceCaps(cuda=True, triton=True)
    )
    g = torch.Generator().manual_seed(0)
    a = quantize_blockwise(torch.randn(76, 576, generator=g), (1, 128))  # DGrad dy: K = 576
    w = quantize_blockwise(torch.randn(576, 2048, generator=g), (128, 128)).t()
    gemm_backends.run_gemm(planned, a, w, torch.bfloat16)
    want = "triton" if planned == "deep_gemm" else planned  # 576 % 16 == 0: cuBLASLt takes it
    assert calls == [want]
    calls.clear()
    b = quantize_blockwise(torch.randn(200, 304, generator=g), (128, 128))
    gemm_backends.run_gemm(
        planned, quantize_blockwise(torch.randn(76, 304, generator=g), (1, 128)), b, torch.bfloat16
    )
    assert calls == ["triton"]  # N = 200: neither takes it


def _exact_operand(rows, k, block, g):
    """E4M3 codes whose 128-wide dots are exact in fp32, power-of-two block scales."""
    m = torch.randint(8, 16, (rows, k), generator=g).float() / 8
    v = m * 2.0 ** torch.randint(0, 4, (rows, k), generator=g).float()
    v = v * (torch.randint(0, 2, (rows, k), generator=g).float() * 2 - 1)
    s = 2.0 ** torch.randint(-3, 4, (-(-rows // block[0]), -(-k // 128)), generator=g).float()
    return BlockQuantized(v.to(torch.float8_e4m3fn), s, block, "e4m3", True)


@pytest.mark.triton
@pytest.mark.parametrize(
    ("m", "n", "k"), [(77, 576, 2048), (77, 2048, 576), (77, 32, 1024), (77, 200, 304)]
)
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
def test_triton_gemm_with_tails_gives_the_reference_bits(m, n, k, b_block):
    """Triton's block GEMM (interpreter on CPU; value tables) with partial N/K tiles: the same
    fp32 bits as the reference on operands whose tile dots are exact."""
    from nemo_jetrl.fp8.triton_gemm import block_fp8_gemm_triton

    g = torch.Generator().manual_seed(m + n + k)
    a, b = _exact_operand(m, k, (1, 128), g), _exact_operand(n, k, b_block, g)
    want = blockwise_matmul(a, b, out_dtype=torch.float32, exact=True)
    if torch.cuda.is_available():
        a, b = (
            BlockQuantized(q.data.cuda(), q.scale_inv.cuda(), q.block, q.fmt, True) for q in (a, b)
        )
    got = block_fp8_gemm_triton(a, b, out_dtype=torch.float32, native=False).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


# --------------------------------------------- the CUDA code path on CPU (Triton interpreter)


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
@pytest.mark.parametrize("shape", ["kv_a_proj_with_mqa", "both_tails"])
def test_cuda_path_gives_the_cpu_bits(shape, cuda_path, monkeypatch):
    """Triton quantizers (rowwise + transposed 128x1 with tails) and the reference GEMMs: the
    same y, dX, dW bits as the CPU path."""
    cfg, (k, n) = CONFIGS["pow2"], SHAPES[shape]
    want = [t.detach().clone() for t in _outs(_layer(k, n, cfg), k)]
    monkeypatch.setenv(gemm_backends.ENV_GEMM_BACKEND, "reference")
    got = _outs(_layer(k, n, cfg), k)
    finite_flags.check_non_finite()
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def _outs(pair, k):
    base, layer = pair
    x, y, _ = run_step(layer, (*TOKENS, k))
    return y.detach(), x.grad, base.weight.grad, base.bias.grad
