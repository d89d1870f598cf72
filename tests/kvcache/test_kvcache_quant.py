"""FP8 KV quantization against a float64 statement of vLLM's cache semantics."""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.kvcache import dequantize_kv, fake_quantize_kv, fake_quantize_kv_ste, quantize_kv
from nemo_jetrl.kvcache.quant import scale_tensor

# All finite non-negative E4M3 values, indexed by their byte code 0x00..0x7E.
GRID = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """Round float64 values to fp32 (one correct rounding), back in float64."""
    return t.float().double()


def ref_cuda_bytes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """vLLM CUDA write in float64: v = fp32(x / s); saturate; round to nearest E4M3, ties even."""
    s = _fp32(torch.tensor(scale, dtype=torch.float64))
    # float64 division then rounding to fp32 equals IEEE fp32 division (53 >= 2*24+2 bits).
    v = _fp32(x.double() / s)
    mag = v.abs().clamp(max=448.0)
    hi = torch.searchsorted(GRID, mag).clamp(max=0x7E)  # first grid value >= mag
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - GRID[lo], GRID[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo)
    code = torch.where(GRID[lo] == mag, lo, code)
    sign = torch.signbit(v).to(torch.int64) << 7
    out = (code | sign).to(torch.uint8)
    return torch.where(torch.isnan(v), torch.tensor(0x7F, dtype=torch.uint8), out)


def ref_cpu_bytes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """vLLM CPU write in float64: v = fp32(x * fp32(1/s)); clamp (NaN -> 448); the exponent
    rebias multiply rounds |v| < 2**-6 to a multiple of 2**-29 (fp32 subnormals, nearest even);
    then truncate toward zero onto the E4M3 grid; zero of either sign is +0."""
    s = _fp32(torch.tensor(scale, dtype=torch.float64))
    inv = _fp32(1.0 / s)
    v = _fp32(x.double() * inv).clamp(-448.0, 448.0)
    v = torch.where(torch.isnan(v), torch.full_like(v, 448.0), v)
    step = 2.0**-29
    small = v.abs() < 2.0**-6
    v = torch.where(small, torch.round(v / step) * step, v)  # torch.round is half-to-even
    mag = v.abs()
    code = (torch.searchsorted(GRID, mag, right=True) - 1).clamp(min=0)  # largest grid <= mag
    sign = torch.signbit(v).to(torch.int64) << 7
    out = (code | sign).to(torch.uint8)
    return torch.where(v == 0, torch.zeros_like(out), out)


def _inputs(dtype: torch.dtype, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    parts = [
        torch.randn(4000, generator=g) * scale * 100,  # typical
        torch.randn(1000, generator=g) * scale * 2000,  # saturating
        torch.randn(1000, generator=g) * scale * 2.0**-7,  # E4M3 subnormal range
        torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 448 * scale, -449 * scale]),
        # ties between neighbouring grid values (exact when scale is a power of two)
        ((GRID[1:] + GRID[:-1]) / 2).float() * scale,
        -((GRID[1:] + GRID[:-1]) / 2).float() * scale,
    ]
    return torch.cat(parts).to(dtype)


SCALES = [0.25, 1.0, 0.0123456, 3.3e-3, 17.5, 2.0**-20]


@pytest.mark.parametrize(
    ("kernel", "dtype"),
    [
        ("cuda", torch.float32),
        ("cuda", torch.bfloat16),
        ("cuda", torch.float16),
        ("cpu", torch.float32),
        ("cpu", torch.bfloat16),
    ],
)
@pytest.mark.parametrize("scale", SCALES)
def test_write_matches_float64(kernel: str, dtype: torch.dtype, scale: float) -> None:
    x = _inputs(dtype, scale)
    got = quantize_kv(x, scale, kernel=kernel).view(torch.uint8)
    ref = (ref_cuda_bytes if kernel == "cuda" else ref_cpu_bytes)(x, scale)
    bad = (got != ref).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} bytes differ, first at x={x[bad[0]].item()!r}"


def test_cpu_kernel_truncates_where_cuda_rounds() -> None:
    # 1.97 lies between E4M3 values 1.875 and 2.0, nearer 2.0: CUDA rounds up, the CPU kernel truncates.
    x = torch.tensor([1.97, -1.97])
    assert quantize_kv(x, 1.0, kernel="cuda").float().tolist() == [2.0, -2.0]
    assert quantize_kv(x, 1.0, kernel="cpu").float().tolist() == [1.875, -1.875]


def test_nan_and_inf_follow_the_kernels() -> None:
    x = torch.tensor([float("nan"), float("inf"), -float("inf")])
    assert quantize_kv(x, 0.5, kernel="cuda").view(torch.uint8).tolist() == [0x7F, 0x7E, 0xFE]
    assert quantize_kv(x, 0.5, kernel="cpu").float().tolist() == [448.0, 448.0, -448.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_read_back_is_one_fp32_multiply(dtype: torch.dtype) -> None:
    scale = 0.0123456
    q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    q = q[~torch.isnan(q.float())]
    got = dequantize_kv(q, scale, dtype)
    s = _fp32(torch.tensor(scale, dtype=torch.float64))
    ref = _fp32(q.double() * s).to(dtype)  # exact product (4 x 24 bits), one fp32 rounding
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [0.0123456, 0.25, 7.0])
def test_fake_quant_is_idempotent(dtype: torch.dtype, scale: float) -> None:
    x = _inputs(dtype, scale)
    x = x[torch.isfinite(x)]
    y = fake_quantize_kv(x, scale)
    assert y.dtype == dtype
    assert torch.equal(fake_quantize_kv(y, scale), y)


def test_straight_through_gradient_is_identity() -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 16, generator=g) * 3).requires_grad_()
    w = torch.randn(64, 16, generator=g)
    y = fake_quantize_kv_ste(x, 0.02)
    assert torch.equal(y.detach(), fake_quantize_kv(x.detach(), 0.02))
    (y * w).sum().backward()
    assert torch.equal(x.grad, w)


def test_straight_through_attention_gradient() -> None:
    """d loss / d k under STE equals the plain gradient evaluated at the quantized keys."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    w = torch.randn(1, 2, 8, 16, generator=g)
    k1 = k.clone().requires_grad_()
    out = torch.nn.functional.scaled_dot_product_attention(q, fake_quantize_kv_ste(k1, 0.01), v)
    (out * w).sum().backward()
    k2 = fake_quantize_kv(k, 0.01).requires_grad_()
    out2 = torch.nn.functional.scaled_dot_product_attention(q, k2, v)
    (out2 * w).sum().backward()
    assert torch.equal(k1.grad, k2.grad)
    assert not torch.equal(fake_quantize_kv(k, 0.01), k)  # the quantization did change the keys


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_invalid_scale_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="finite positive"):
        scale_tensor(bad, name="model.layers.3.self_attn.k_scale")
    with pytest.raises(ValueError, match="finite positive"):
        quantize_kv(torch.ones(3), bad)


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vllm_cuda_cache_write_matches_bit_for_bit(dtype: torch.dtype) -> None:
    """The real thing: vLLM's CUDA `reshape_and_cache_flash` stores the bytes `quantize_kv` does."""
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(3)
    tokens, heads, dim, block = 40, 2, 128, 16
    ks, vs = 0.0123456, 0.00456
    key = (torch.randn(tokens, heads, dim, generator=g) * 3).to(dtype)
    value = (torch.randn(tokens, heads, dim, generator=g) * 0.5).to(dtype)
    key[0, 0, :4] = torch.tensor([1.97 * ks, 1e4, 1e-7, -0.0], dtype=dtype)
    nb = -(-tokens // block)
    kc = torch.zeros(nb, block, heads, dim, dtype=torch.uint8, device="cuda")
    vc = torch.zeros_like(kc)
    ops.reshape_and_cache_flash(
        key.cuda(), value.cuda(), kc, vc, torch.arange(tokens, device="cuda"), "fp8",
        torch.tensor([ks], device="cuda"), torch.tensor([vs], device="cuda"),
    )  # fmt: skip
    got_k = kc.reshape(-1, heads, dim)[:tokens].cpu()
    got_v = vc.reshape(-1, heads, dim)[:tokens].cpu()
    assert torch.equal(got_k, quantize_kv(key, ks, kernel="cuda").view(torch.uint8))
    assert torch.equal(got_v, quantize_kv(value, vs, kernel="cuda").view(torch.uint8))


def test_cuda_write_divides_once_like_vllms_cache_kernel():
    """vLLM's CUDA cache write is one IEEE fp32 division x / scale, then E4M3 round-to-nearest-
    even: bytes equal a float64-division reference (exact for fp32 division). The inputs sit
    exactly on E4M3 ties (x = midpoint * scale, exact in fp32), where multiplying by the rounded
    reciprocal (the CPU kernel's rule) breaks the tie the other way on about half of them."""
    from nemo_jetrl.kvcache.quant import quantize_kv

    g = torch.Generator().manual_seed(0)
    e4m3 = torch.arange(0, 126, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # < 448
    mids = ((e4m3[1:] + e4m3[:-1]) / 2)[8:]  # ties between normal neighbours
    differ = 0
    for _ in range(20):
        s = float(torch.rand((), generator=g) * 0.05 + 1e-3)
        s = float(torch.tensor(s).view(torch.int32).bitwise_and(-256).view(torch.float32))
        x = mids * s  # exact: <= 5 significant bits times a 16-bit scale
        assert torch.equal(x.double() / s, mids.double())
        got = quantize_kv(x, s, kernel="cuda").view(torch.uint8)
        ref = (x.double() / s).float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(got, ref)
        recip = (x * torch.reciprocal(torch.tensor(s))).clamp(-448, 448).to(torch.float8_e4m3fn)
        differ += int((recip.view(torch.uint8) != ref).sum())
    assert differ > 0  # the inputs tell the two rules apart


def test_scales_never_read_a_tensor_back_to_the_host() -> None:
    """The trainer's on-policy KV calls this for K and V of every layer in every micro-batch: a
    read of a GPU tensor (``float(s)``, found by reading, 2026-12-01: 2-3 syncs a call) stalls
    the host each time. A Python scale is checked on the host and filled on the device; a
    tensor scale off the CPU is checked there (on ``meta`` here, as a GPU's would be)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:  # no autograd (scoring, calibration): a Python scale end to end
        fake_quantize_kv(torch.randn(4, 8), 0.03125)
    assert "_local_scalar_dense" not in ops.names and "full" in ops.names, ops.names
    xm = torch.empty(4, 8, device="meta").requires_grad_(True)
    with Ops() as ops:  # the trainer's straight-through path, its scale made on x's device
        out = fake_quantize_kv_ste(xm, 0.5)
        out.sum().backward()
    assert out.device.type == "meta" and xm.grad is not None
    assert "_local_scalar_dense" not in ops.names and "_assert_async" in ops.names, ops.names
    with pytest.raises(ValueError, match="finite positive"):  # a CPU tensor: checked at once
        scale_tensor(torch.tensor(float("nan")))


def test_the_trainer_mirrors_the_rollouts_cache_writer() -> None:
    from nemo_jetrl.kvcache import rollout_cache_kernel

    assert rollout_cache_kernel("vllm", "cpu") == "cpu"  # vLLM's CPU writer truncates
    assert rollout_cache_kernel("vllm", "cuda") == "cuda"
    assert rollout_cache_kernel("hf") == rollout_cache_kernel("hf", "cuda") == "cuda"
    for bad in (("sglang", "cpu"), ("vllm", "rocm")):
        with pytest.raises(ValueError, match="rollout engine"):
            rollout_cache_kernel(*bad)
