"""The serving path's quantizer (``check_finite=False``): no host reads, NaN for non-finite blocks.

vLLM captures its forward in CUDA graphs; a host read (``bool(t)``, ``.item()``) inside the
quantizer is an error during capture and a device sync per layer in eager mode. On CPU the same
torch ops run, so `sync_check.no_host_reads` (a function- and dispatch-mode detector) catches them here; the
Triton kernel runs under ``TRITON_INTERPRET=1``. The real capture is in the `gpu` tests.
"""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.fp8 import BlockQuantized, fp8_bits, quantize_blockwise
from nemo_jetrl.fp8.sync_check import HostReadError, no_host_reads

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]
# Compiled Triton on a GPU, its interpreter on CPU (conftest sets TRITON_INTERPRET there).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCKS = [(1, 128), (128, 128), (128, 1)]


def _x(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(150, 300, generator=g) * torch.logspace(-3, 3, 300)).to(torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unchecked_quantize_reads_nothing_on_the_host(backend):
    x = _x()
    xd = x.to(DEVICE)
    kw = {"pow2_scales": False, "backend": backend}
    quantize_blockwise(xd, (1, 128), check_finite=False, **kw)  # compiles outside the detector
    with no_host_reads() as mode:
        q = quantize_blockwise(xd, (1, 128), check_finite=False, **kw)
    assert mode.ops_seen > 0
    ref = quantize_blockwise(x, (1, 128), pow2_scales=False)
    assert torch.equal(fp8_bits(q.data.cpu()), fp8_bits(ref.data))
    assert torch.equal(q.scale_inv.cpu().view(torch.int32), ref.scale_inv.view(torch.int32))
    # The detector does catch the checked path's finiteness test (what issue 16 found).
    with pytest.raises(HostReadError, match=r"__bool__"), no_host_reads():
        quantize_blockwise(xd, (1, 128), **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("pow2", [True, False])
def test_unchecked_non_finite_blocks_get_nan_scale_inv(backend, block, pow2):
    """Both backends: NaN ``scale_inv`` exactly on the blocks holding NaN/inf (also with pow2
    scales, where masking a NaN scale's bits would have produced inf and scale_inv 0), and the
    other blocks bit-identical to quantizing the finite input."""
    x = _x(1)
    clean = x.clone()
    x[3, 5], x[140, 290] = float("nan"), float("-inf")
    q = quantize_blockwise(
        x.to(DEVICE), block, pow2_scales=pow2, backend=backend, check_finite=False
    )
    q = BlockQuantized(q.data.cpu(), q.scale_inv.cpu(), q.block, q.fmt, q.pow2_scales)
    ref = quantize_blockwise(clean, block, pow2_scales=pow2)
    bm, bk = block
    bad = torch.zeros_like(ref.scale_inv, dtype=torch.bool)
    for r, c in ((3, 5), (140, 290)):
        bad[r // bm, c // bk] = True
    assert torch.equal(torch.isnan(q.scale_inv), bad)
    good = ~bad
    assert torch.equal(q.scale_inv[good].view(torch.int32), ref.scale_inv[good].view(torch.int32))
    keep = good.repeat_interleave(bm, 0)[:150].repeat_interleave(bk, 1)[:, :300]
    assert torch.equal(fp8_bits(q.data)[keep], fp8_bits(ref.data)[keep])


def test_unchecked_quantize_compiles_fullgraph():
    """torch.compile(fullgraph=True) refuses any data-dependent host read: the serving path
    compiles, the checked path does not."""

    def serve(x):
        q = quantize_blockwise(x, (1, 128), pow2_scales=False, backend="torch", check_finite=False)
        return q.data, q.scale_inv

    def checked(x):
        q = quantize_blockwise(x, (1, 128), pow2_scales=False, backend="torch")
        return q.data, q.scale_inv

    x = _x()[:16]
    data, sinv = torch.compile(serve, fullgraph=True, backend="eager")(x)
    ref = quantize_blockwise(x, (1, 128), pow2_scales=False)
    assert torch.equal(fp8_bits(data), fp8_bits(ref.data)) and torch.equal(sinv, ref.scale_inv)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="data-dependent"):
        torch.compile(checked, fullgraph=True, backend="eager")(x)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [True, False])
def test_gpu_unchecked_quantize_is_sync_free_and_graph_capturable(pow2):
    x = _x().cuda()
    kw = {"pow2_scales": pow2, "check_finite": False}
    quantize_blockwise(x, (1, 128), **kw)  # Triton compiles outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        quantize_blockwise(x, (1, 128), **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = quantize_blockwise(x, (1, 128), **kw)
    x.mul_(-2)  # new input in the same buffer, as vLLM replays
    graph.replay()
    torch.cuda.synchronize()
    ref = quantize_blockwise(x.cpu(), (1, 128), pow2_scales=pow2)
    assert torch.equal(fp8_bits(q.data.cpu()), fp8_bits(ref.data))
    assert torch.equal(q.scale_inv.cpu(), ref.scale_inv)
