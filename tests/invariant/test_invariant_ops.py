"""nemo_jetrl.invariant.ops: accuracy against float64 with stated bounds, and the invariance
property itself (a row's bits do not depend on the batch, the number of rows, or trailing
masked/absent positions) checked bit for bit on many shapes."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_jetrl.invariant import ops

FP32_U = 2.0**-24  # unit roundoff


def _ulps(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|y - ref| in units of the fp32 spacing at ref (normal range)."""
    spacing = torch.exp2(torch.floor(torch.log2(ref.abs())) - 23)
    return (y.double() - ref).abs() / spacing


def test_exp_within_two_ulp_of_float64_over_the_normal_range():
    x = torch.cat([torch.linspace(-87.0, 88.7, 400_001), torch.randn(10_000) * 3])
    ref = torch.exp(x.double())
    assert _ulps(ops.exp(x), ref).max().item() <= 2.0


def test_log_within_two_ulp_or_1e7_absolute_of_float64():
    x = torch.exp(torch.linspace(-87.0, 88.0, 400_001))
    ref = torch.log(x.double())
    err = (ops.log(x).double() - ref).abs()
    ok = (err <= 1.2e-7) | (_ulps(ops.log(x), ref) <= 2.0)
    assert bool(ok.all()), err.max()


def test_exp_and_log_special_values():
    e = ops.exp(torch.tensor([-math.inf, math.inf, math.nan, 0.0, -200.0, 100.0]))
    assert e[0] == 0 and e[1] == math.inf and math.isnan(e[2]) and e[3] == 1.0
    assert e[4] == 0 and e[5] == math.inf
    sub = torch.tensor([1e-40, 1e-45])  # subnormal inputs
    assert torch.allclose(ops.log(sub).double(), torch.log(sub.double()), rtol=1e-6)
    lg = ops.log(torch.tensor([0.0, math.inf, math.nan, -1.0, 1.0]))
    assert lg[0] == -math.inf and lg[1] == math.inf and math.isnan(lg[2]) and math.isnan(lg[3])
    assert lg[4] == 0.0


def test_exp_and_log_gradients_match_autograd_of_torch():
    x = torch.randn(64, dtype=torch.float32, requires_grad=True)
    (g,) = torch.autograd.grad(ops.exp(x).sum(), x)
    assert torch.allclose(g, torch.exp(x.detach()), rtol=3e-7)
    y = (torch.rand(64) + 0.1).requires_grad_()
    (g,) = torch.autograd.grad(ops.log(y).sum(), y)
    assert torch.allclose(g, 1 / y.detach(), rtol=3e-7)


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 100, 256, 1000])
def test_tree_sum_is_unchanged_by_trailing_zeros_and_by_the_batch(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(37, n, generator=g)
    s = ops.tree_sum(x)
    for extra in (1, 5, 64, 300):
        padded = torch.cat([x, torch.zeros(37, extra)], dim=1)
        assert torch.equal(ops.tree_sum(padded), s)
    for i in (0, 13, 36):  # one row alone, and inside another batch
        assert torch.equal(ops.tree_sum(x[i : i + 1]), s[i : i + 1])
        assert torch.equal(ops.tree_sum(torch.cat([x[i : i + 1], -x])[:1]), s[i : i + 1])
    bound = n * FP32_U * x.double().abs().sum(-1)  # recursive summation error bound
    assert bool(((s.double() - x.double().sum(-1)).abs() <= bound).all())


def test_tree_sum_normalises_signed_zeros():
    x = torch.tensor([[-0.0, -0.0, -0.0]])
    assert ops.tree_sum(x).item() == 0 and not torch.signbit(ops.tree_sum(x)).item()


def test_softmax_masked_and_absent_positions_are_the_same():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 9, generator=g) * 4
    masked = torch.cat([x, torch.full((5, 7), -math.inf)], dim=1)
    p, pm = ops.softmax(x), ops.softmax(masked)
    assert torch.equal(pm[:, :9], p) and bool((pm[:, 9:] == 0).all())
    ref = torch.softmax(x.double(), -1)
    assert ((p.double() - ref).abs() <= 16 * FP32_U * ref + 1e-30).all()
    lref = torch.log_softmax(x.double(), -1)
    assert ((ops.log_softmax(x).double() - lref).abs() <= 8 * FP32_U * (lref.abs() + 4)).all()


def test_linear_rows_do_not_depend_on_the_batch_and_match_float64():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(17, 256, generator=g) * 0.05).bfloat16()
    x = torch.randn(300, 256, generator=g).bfloat16()
    y = ops.linear(x, w)
    for rows in (slice(0, 1), slice(5, 6), slice(7, 70)):
        assert torch.equal(ops.linear(x[rows], w), y[rows])
    ref = x.double() @ w.double().t()
    bound = 256 * FP32_U * (x.double().abs() @ w.double().abs().t()) + ref.abs() * 2.0**-8
    assert bool(((y.double() - ref).abs() <= bound).all())  # fp32 sum + one bf16 rounding


def test_attention_decode_step_equals_the_full_causal_forward_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    b, h, t, d = 3, 4, 11, 64
    q, k, v = (torch.randn(b, h, t, d, generator=g).bfloat16() for _ in range(3))
    causal = torch.full((t, t), -3.0e38).triu(1)
    full, _ = ops.attention(q, k, v, causal, d**-0.5)
    for i in (0, 4, t - 1):  # query i alone, seeing keys 0..i (a decode step)
        step, _ = ops.attention(
            q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1], None, d**-0.5
        )
        assert torch.equal(step[:, 0], full[:, i])
    ref = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * d**-0.5 + causal, -1)
    ref = (ref @ v.double()).transpose(1, 2)
    assert (full.double() - ref).abs().max().item() < 2.0**-6  # bf16 probabilities and output


def test_attention_and_linear_gradients_match_float64_autograd():
    """The backward uses torch's GEMMs: gradients within bf16 rounding of float64 autograd."""
    g = torch.Generator().manual_seed(3)
    b, h, t, d = 2, 2, 7, 64
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))
    causal = torch.full((t, t), -3.0e38).triu(1)
    w = torch.randn(17, 64, generator=g) * 0.1
    ins = [x.clone().requires_grad_() for x in (q, k, v, w)]
    out, _ = ops.attention(*ins[:3], causal, d**-0.5)
    ops.linear(out, ins[3]).square().sum().backward()
    ref = [x.double().clone().requires_grad_() for x in (q, k, v, w)]
    p = torch.softmax(ref[0] @ ref[1].transpose(-1, -2) * d**-0.5 + causal.double(), -1)
    ((p @ ref[2]).transpose(1, 2) @ ref[3].t()).square().sum().backward()
    for got, want in zip(ins, ref, strict=True):
        err = (got.grad.double() - want.grad).abs().max().item()
        assert err <= 1e-4 * want.grad.abs().max().item(), err
