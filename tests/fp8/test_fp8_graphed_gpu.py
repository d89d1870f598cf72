"""`fp8.graph_linear` on a GPU: a graphed training step has the eager step's bits, sees every
optimizer step, accumulates micro-batches right, flags non-finite input, and refuses what would
give a wrong gradient. `gpu`: skipped without CUDA (CPU parts: test_fp8_graphed.py)."""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.fp8 import Fp8BlockLinear, Fp8LinearConfig, finite_flags, graph_linear

pytestmark = [pytest.mark.gpu]
M, K, N = 512, 1024, 768


def _layers(kind: str, bias: bool):
    """Two layers with the same initial weights: one to run eagerly, one to graph."""
    torch.manual_seed(0)
    base = torch.nn.Linear(K, N, bias=bias, device="cuda", dtype=torch.bfloat16)
    out = []
    for _ in range(2):
        lin = torch.nn.Linear(K, N, bias=bias, device="cuda", dtype=torch.bfloat16)
        lin.load_state_dict(base.state_dict())
        if kind == "bf16":
            out.append(lin)
        else:
            cfg = Fp8LinearConfig(pow2_scales=kind == "fp8_pow2")
            out.append(Fp8BlockLinear.from_linear(lin, cfg, name=f"blk.{kind}"))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("kind", ["fp8_pow2", "fp8_fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_graphed_steps_have_the_eager_bits_across_optimizer_steps(kind, bias):
    eager, layer = _layers(kind, bias)
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(M, K, device="cuda", generator=g).bfloat16() for _ in range(6)]
    dys = [torch.randn(M, N, device="cuda", generator=g).bfloat16() for _ in range(6)]
    graphed = graph_linear(layer, xs[0].requires_grad_(True))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, graphed)]
    for step in range(3):  # 2 micro-batches, then an optimizer step (the weight changes)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        for mb in (2 * step, 2 * step + 1):
            got = []
            for m in (eager, graphed):
                x = xs[mb].detach().requires_grad_(True)
                y = m(x)
                y.backward(dys[mb])
                got.append((y, x.grad))
            assert _same(got[0][0], got[1][0]) and _same(got[0][1], got[1][1]), (step, mb)
        for pe, pg in zip(eager.parameters(), graphed.parameters(), strict=True):
            assert _same(pe.grad, pg.grad), step  # both micro-batches, each counted once
        for opt in opts:
            opt.step()
    finite_flags.check_non_finite()  # nothing flagged


def test_a_backward_whose_forward_was_overwritten_raises():
    _, layer = _layers("fp8_pow2", False)
    x = torch.randn(M, K, device="cuda").bfloat16().requires_grad_(True)
    graphed = graph_linear(layer, x)
    first = graphed(x)
    second = graphed(x)  # the graph's saved operands are now the second micro-batch's
    with pytest.raises(RuntimeError, match="this backward's forward was overwritten"):
        first.sum().backward()
    second.sum().backward()  # its own backward is fine


def test_non_finite_input_is_flagged_through_the_graph_and_other_shapes_refused():
    _, layer = _layers("fp8_pow2", False)
    x = torch.randn(M, K, device="cuda").bfloat16().requires_grad_(True)
    graphed = graph_linear(layer, x)
    finite_flags.check_non_finite()
    bad = x.detach().clone()
    bad[3, 5] = float("nan")
    graphed(bad.requires_grad_(True)).sum().backward()
    with pytest.raises(ValueError, match=r"blk.fp8_pow2.input"):
        finite_flags.check_non_finite()
    graphed(x).sum().backward()
    finite_flags.check_non_finite()  # read and cleared: the next replay starts clean
    with pytest.raises(ValueError, match=r"captured for input \[512, 1024\] bfloat16"):
        graphed(x[:256])
    with torch.no_grad():  # no backward wanted: the eager layer runs
        assert graphed(x[:256]).shape == (256, N)
