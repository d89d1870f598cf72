"""The ``triton_splitk`` GEMM (`triton_split`): its fixed split order, its bits, its two modes.

CPU (Triton's interpreter, where the tile dot is exact): every output equals the pure-torch
reference `split_order_matmul` bit for bit in both launch modes, so a token's row is the same at
every M; the fused activation quantization gives the quantizer's codes. GPU (``gpu`` tests): the
tensor cores round inside a tile's dot, so there the claims are row invariance M = 1..8192 and
the serving path's rows equal to the trainer's forward, on Qwen3-8B's shapes.
"""

from __future__ import annotations

import pytest
import torch
from triton_setup import TRITON_MARKS

from nemo_jetrl.fp8 import gemm_backends, quantize_blockwise
from nemo_jetrl.fp8.gemm import blockwise_matmul
from nemo_jetrl.fp8.split_order import chunk_bounds, split_count, split_order_matmul
from nemo_jetrl.fp8.triton_launch import interpreting

triton_split = pytest.importorskip("nemo_jetrl.fp8.triton_split")
pytestmark = TRITON_MARKS
# The exact tile dot (float64) is the interpreter's: on a GPU the `gpu` tests below hold instead.
interpreter_bits = pytest.mark.skipif(
    not interpreting(), reason="the reference's bits need Triton's CPU interpreter"
)
BF16, FP32 = torch.bfloat16, torch.float32


def _operands(m, n, k, *, pow2, seed, w_block=(128, 128), w_fmt="e4m3", device="cpu"):
    g = torch.Generator(device).manual_seed(seed)  # made where used: 100M values on a GPU
    # scaled per row so the 1x128 scales differ (FP32 scales then round in the order's steps)
    x = torch.randn(m, k, generator=g, device=device)
    x = (x * torch.exp(torch.randn(m, 1, generator=g, device=device))).to(BF16)
    w = (torch.randn(n, k, generator=g, device=device) * 0.05).to(BF16)
    qx = quantize_blockwise(x, (1, 128), pow2_scales=pow2)
    qw = quantize_blockwise(w, w_block, fmt=w_fmt, pow2_scales=pow2)
    return x, qx, qw


def _rows(q, m):
    return type(q)(q.data[:m], q.scale_inv[:m], q.block, q.fmt, q.pow2_scales)


# --------------------------------------------------------------------------------- the rule


def test_the_split_is_a_function_of_k_alone():
    # Literals (the bits' definition, `split_order.CHUNK_TILES` = 8 tiles of 128): Qwen3-8B's
    # K = 4096 (qkv, o, gate_up) gives 4 chunks, the down projection's K = 12288 gives 12.
    assert [split_count(k) for k in (1, 128, 1024, 1025, 4096, 12288)] == [1, 1, 1, 2, 4, 12]
    assert chunk_bounds(2500) == [(0, 1024), (1024, 2048), (2048, 2500)]
    launches = {m: triton_split.launch_for(m, 4096) for m in (1, 16, 17, 33, 64, 65, 8192)}
    assert [launches[m].token_tile for m in launches] == [16, 16, 32, 64, 64, 64, 64]
    assert [launches[m].split for m in launches] == [True] * 5 + [False] * 2
    assert [launches[m].warpgroups for m in launches] == [1] * 5 + [2] * 2
    assert not triton_split.launch_for(1, 1024).split  # one chunk: nothing to split


def test_the_order_differs_from_one_chain_so_the_bit_tests_can_fail():
    """FP32 scales over 3 chunks: the fixed split's bits are not the single TE chain's (a
    kernel that forgot the split would fail the tests below), nor the reversed fold's."""
    _, qx, qw = _operands(24, 64, 2500, pow2=False, seed=1)
    split = split_order_matmul(qx, qw, out_dtype=FP32)
    chain = blockwise_matmul(qx, qw, out_dtype=FP32, exact=True)
    assert not torch.equal(split, chain)
    parts = [
        split_order_matmul(
            type(qx)(qx.data[:, k0:k1], qx.scale_inv[:, k0 // 128 : -(-k1 // 128)], qx.block,
                     qx.fmt, qx.pow2_scales),
            type(qw)(qw.data[:, k0:k1], qw.scale_inv[:, k0 // 128 : -(-k1 // 128)], qw.block,
                     qw.fmt, qw.pow2_scales),
            out_dtype=FP32,
        )
        for k0, k1 in chunk_bounds(2500)
    ]  # fmt: skip
    assert torch.equal(split, (parts[0] + parts[1]) + parts[2])
    assert not torch.equal(split, parts[0] + (parts[1] + parts[2]))


# --------------------------------------------------------------------- bits (interpreter)


@interpreter_bits
@pytest.mark.parametrize("pow2", [True, False])
def test_both_modes_give_the_references_bits_and_each_row_is_batch_invariant(pow2):
    # K = 2500: 3 chunks, a partial last tile; N = 200: a partial 64-row tile and 128-block
    _, qx, qw = _operands(70, 200, 2500, pow2=pow2, seed=2 + pow2)
    want = split_order_matmul(qx, qw, out_dtype=FP32)
    for split in (True, False):
        assert torch.equal(triton_split.split_gemm(qx, qw, out_dtype=FP32, split=split), want)
    assert torch.equal(triton_split.split_gemm(qx, qw, out_dtype=BF16), want.to(BF16))
    for m in (1, 3, 16, 17, 33, 64):  # every token tile, split mode up to 64
        got = triton_split.split_gemm(_rows(qx, m), qw, out_dtype=FP32)
        assert torch.equal(got, want[:m]), m


@interpreter_bits
def test_weight_through_a_tma_descriptor_gives_the_same_bits(monkeypatch):
    """`SPLIT_TMA`: the weight's codes loaded by a TMA descriptor give the pointer loads' bits in
    both modes: a partial 64-row tile (N = 200: rows past N read as zeros) and a partial last K
    tile (K = 1152 = 9 x 128 in 2 chunks: whole; 1088: a 64-wide last tile), the fused
    quantization included."""
    real, launched = triton_split._weight_descriptor, []

    def descriptor(qb, rows):  # type: ignore[no-untyped-def]
        launched.append(rows)
        return real(qb, rows)

    for k in (1152, 1088):
        x, qx, qw = _operands(70, 200, k, pow2=False, seed=k)
        want = {split: triton_split.split_gemm(qx, qw, out_dtype=FP32, split=split)
                for split in (True, False)}  # fmt: skip
        fused = triton_split.split_linear(x[:5], qw, pow2_scales=False, out_dtype=FP32)
        launched.clear()
        monkeypatch.setattr(triton_split, "_weight_descriptor", descriptor)
        monkeypatch.setattr(triton_split, "SPLIT_TMA", True)
        for split in (True, False):
            got = triton_split.split_gemm(qx, qw, out_dtype=FP32, split=split)
            assert torch.equal(got, want[split]), (k, split)
        got = triton_split.split_linear(x[:5], qw, pow2_scales=False, out_dtype=FP32)
        assert torch.equal(got, fused), k
        assert launched == [128, 128, 64]  # a descriptor a call: 70 tokens take 128-row blocks
        monkeypatch.setattr(triton_split, "SPLIT_TMA", False)
        monkeypatch.setattr(triton_split, "_weight_descriptor", real)


@interpreter_bits
def test_split_mode_is_one_launch_whose_last_program_folds_and_rezeroes_its_counter(monkeypatch):
    """Split mode launches once: each tile's S programs count themselves on the stream's tile
    counters and the last to arrive adds the partials in chunk order (so the bits are not the
    arrival order's), then sets its counter back to zero for the next call. A counter left at 1
    makes a tile fold one partial early: other bits (the counters decide the result)."""
    _, qx, qw = _operands(5, 200, 2500, pow2=False, seed=4)
    want = split_order_matmul(qx, qw, out_dtype=FP32)
    launched = []
    real = triton_split.launch

    def counting(kernel, grid, args, meta):  # type: ignore[no-untyped-def]
        launched.append((kernel.__name__, tuple(grid)))
        return real(kernel, grid, args, meta)

    monkeypatch.setattr(triton_split, "launch", counting)
    assert torch.equal(triton_split.split_gemm(qx, qw, out_dtype=FP32), want)
    assert launched == [("split_gemm_kernel", (4, 1, 3))]  # 200 rows / 64, 5 tokens, 3 chunks
    counters = triton_split._counters(qw.data.device, 4)
    assert int(counters.count_nonzero()) == 0
    assert torch.equal(triton_split.split_gemm(qx, qw, out_dtype=FP32), want)  # reused as is
    # planted: tile 0 counts one program too many, on other operands of the same shapes (the
    # early fold adds a chunk's partial before it is written: on these operands the workspace,
    # torch.empty of the same size, can hold the previous call's partial, the same bits)
    _, qx, qw = _operands(5, 200, 2500, pow2=False, seed=5)
    want = split_order_matmul(qx, qw, out_dtype=FP32)
    counters[0] = 1
    try:
        got = triton_split.split_gemm(qx, qw, out_dtype=FP32)
    finally:
        counters.zero_()
    assert not torch.equal(got[:, :64], want[:, :64]) and torch.equal(got[:, 64:], want[:, 64:])


@interpreter_bits
def test_two_warpgroups_at_the_decode_sizes_give_the_same_bits(monkeypatch):
    """`DECODE_WARPGROUPS = 2` (a sweep variant): split-mode programs of 128 weight rows, half as
    many (200 rows: 2 tiles, the second partial), give the default's bits, fused quantization
    included; above `SPLIT_MAX_M` the prefill's two warpgroups are unchanged."""
    x, qx, qw = _operands(5, 200, 2500, pow2=False, seed=6)
    want = split_order_matmul(qx, qw, out_dtype=FP32)
    fused = triton_split.split_linear(x, qw, pow2_scales=False, out_dtype=FP32)
    launched = []
    real = triton_split.launch

    def counting(kernel, grid, args, meta):  # type: ignore[no-untyped-def]
        launched.append((tuple(grid), meta["BW"], meta["num_warps"]))
        return real(kernel, grid, args, meta)

    monkeypatch.setattr(triton_split, "launch", counting)
    monkeypatch.setattr(triton_split, "DECODE_WARPGROUPS", 2)
    assert torch.equal(triton_split.split_gemm(qx, qw, out_dtype=FP32), want)
    assert torch.equal(triton_split.split_linear(x, qw, pow2_scales=False, out_dtype=FP32), fused)
    assert launched == [((2, 1, 3), 128, 8)] * 2
    assert triton_split.launch_for(65, 4096).warpgroups == triton_split.PREFILL_WARPGROUPS == 2
    monkeypatch.setattr(triton_split, "PREFILL_WARPGROUPS", 1)
    assert triton_split.launch_for(64, 4096).warpgroups == 2  # the decode knob, not prefill's


def test_the_tile_counters_are_made_when_the_backend_is_planned(monkeypatch):
    """Planning ``triton_splitk`` makes the device's counters (zeros), so a CUDA graph captured
    later finds them made (inside a capture they would be recorded unzeroed: refused on a GPU)."""
    monkeypatch.setattr(triton_split, "_COUNTER_BUFFERS", {})
    gemm_backends._plan_cached.cache_clear()
    try:
        gemm_backends.plan_gemm(
            torch.device("cpu"), out_dtype=BF16, pow2_scales=False, backend="triton_splitk"
        )
    finally:
        gemm_backends._plan_cached.cache_clear()
    (made,) = triton_split._COUNTER_BUFFERS.values()
    assert made.dtype == torch.int32 and made.numel() == triton_split.COUNTERS
    assert int(made.count_nonzero()) == 0 and triton_split.prepare("cpu") is made
    with pytest.raises(ValueError, match="at most COUNTERS"):
        triton_split._counters(torch.device("cpu"), triton_split.COUNTERS + 1)


@interpreter_bits
def test_wgrad_and_mixed_format_pairs():
    """The WGrad pair (b 1x128: a scale per row of b) and the hybrid recipe's E5M2 x E4M3."""
    _, qx, qw = _operands(20, 72, 1300, pow2=False, seed=5, w_block=(1, 128))
    for split in (True, False):
        got = triton_split.split_gemm(qx, qw, out_dtype=FP32, split=split)
        assert torch.equal(got, split_order_matmul(qx, qw, out_dtype=FP32))
    g = torch.Generator().manual_seed(6)
    dy = quantize_blockwise(torch.randn(9, 1300, generator=g).to(BF16), (1, 128), fmt="e5m2")
    _, _, w = _operands(1, 96, 1300, pow2=False, seed=7)
    got = triton_split.split_gemm(dy, w, out_dtype=FP32)
    assert torch.equal(got, split_order_matmul(dy, w, out_dtype=FP32))


@interpreter_bits
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_fused_quantization_gives_the_quantizers_codes(dtype):
    x, _, qw = _operands(20, 130, 1300, pow2=False, seed=8)
    x = x.to(dtype)
    x[4, 300] = float("inf")  # token 4's second block is non-finite: its row only is NaN
    for pow2 in (True, False):
        qx = quantize_blockwise(x, (1, 128), pow2_scales=pow2, eps=1e-12, check_finite=False)
        want = split_order_matmul(qx, qw, out_dtype=FP32)
        for m in (1, 5, 20):
            for fused in (True, False):
                got = triton_split.split_linear(
                    x[:m], qw, pow2_scales=pow2, eps=1e-12, out_dtype=FP32, fused=fused
                )
                rows = [i for i in range(m) if i != 4]
                assert torch.equal(got[rows], want[:m][rows]), (m, fused, pow2)
                if m > 4:
                    assert bool(got[4].isnan().all())


def test_refuses_operands_by_name():
    _, _, qw = _operands(4, 64, 256, pow2=True, seed=9)
    with pytest.raises(ValueError, match=r"split_gemm: needs a 1x128"):
        triton_split.split_gemm(qw, qw)
    with pytest.raises(ValueError, match=r"split_linear: operands must be 2-D with the same K"):
        triton_split.split_linear(torch.zeros(2, 128), qw, pow2_scales=True)
    with pytest.raises(ValueError, match=r"split_linear: x is torch.int32"):
        triton_split.split_linear(torch.zeros(2, 256, dtype=torch.int32), qw, pow2_scales=True)


def test_dependent_launches_are_refused_where_they_cannot_run(monkeypatch):
    """`SPLIT_PDL` set: off under the interpreter (its inline assembly cannot run there; the bits
    do not depend on it), and on a device without griddepcontrol (before sm_90) refused naming
    the knob, rather than timed as the default under the variant's name."""
    monkeypatch.setattr(triton_split, "SPLIT_PDL", True)
    monkeypatch.setattr(triton_split, "interpreting", lambda: True)
    assert triton_split._pdl(torch.device("cpu")) is False
    monkeypatch.setattr(triton_split, "interpreting", lambda: False)
    monkeypatch.setattr(triton_split, "_pdl_capable", lambda device: device.index == 1)
    with pytest.raises(RuntimeError, match=r"SPLIT_PDL needs a GPU of sm_90 or later.*cuda:0"):
        triton_split._pdl(torch.device("cuda", 0))
    assert triton_split._pdl(torch.device("cuda", 1)) is True
    monkeypatch.setattr(triton_split, "SPLIT_PDL", False)
    assert triton_split._pdl(torch.device("cuda", 0)) is False


# ------------------------------------------------------------------- as a planned backend


@interpreter_bits
def test_serving_rows_equal_the_trainers_forward_on_triton_splitk():
    """The serving op (`serving_forward`, what the patched vLLM layer runs) at M = 1..40 vs the
    trainer's forward over all 40 tokens (`fp8_linear_forward` on the same backend)."""
    from nemo_jetrl.fp8.linear import fp8_linear_forward
    from nemo_jetrl.vllm_patch import serving_ops

    x, qx, qw = _operands(40, 136, 1300, pow2=False, seed=10)
    plan = gemm_backends.plan_gemm(
        "cpu", out_dtype=BF16, pow2_scales=False, backend="triton_splitk"
    )
    assert plan.backend == "triton_splitk"
    want = fp8_linear_forward(qx, qw, None, BF16, backend=plan.backend)
    ops = serving_ops.ensure_ops()
    for m in (1, 2, 7, 16, 40):
        got = serving_ops.serving_forward(
            ops, x[:m], qw.data, qw.scale_inv, plan.backend, BF16, (False, False, 0.0)
        )
        assert torch.equal(got, want[:m]), m


# ------------------------------------------------------------------------------------- GPU

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("name", list(QWEN3_8B))
def test_gpu_every_row_at_every_batch_size_equals_the_trainers_forward(name, pow2):
    """Qwen3-8B's linears on the GPU: the serving op's rows at M = 1..64 (split mode, fused
    quantization up to 16) and at 65..8192 equal the trainer's forward over 8192 tokens."""
    from nemo_jetrl.fp8.linear import fp8_linear_forward
    from nemo_jetrl.vllm_patch import serving_ops

    n, k = QWEN3_8B[name]
    x, qx, qw = _operands(8192, n, k, pow2=pow2, seed=11, device="cuda")
    want = fp8_linear_forward(qx, qw, None, BF16, backend="triton_splitk")
    ops = serving_ops.ensure_ops()
    for m in (1, 2, 3, 8, 15, 16, 17, 31, 32, 33, 64, 65, 255, 256, 1000, 8192):
        got = serving_ops.serving_forward(
            ops, x[:m], qw.data, qw.scale_inv, "triton_splitk", BF16, (pow2, pow2, 0.0)
        )
        bad = (got != want[:m]).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"{name} M={m}: rows {bad[:8]} differ from the trainer's forward"


@pytest.mark.gpu
def test_gpu_split_gemm_is_graph_capturable_and_within_the_gemm_bound():
    x, qx, qw = _operands(8, 4096, 4096, pow2=False, seed=12, device="cuda")
    out = triton_split.split_linear(x, qw, pow2_scales=False)  # compiled before capture
    ref = split_order_matmul(_to_cpu(qx), _to_cpu(qw), out_dtype=FP32)
    # Hopper's FP8 dot keeps ~14 bits per group of 32 products (results/README.md): 2**-9 of
    # |A||B|, the bound the other GPU GEMM tests use
    bound = _to_cpu(qx).dequantize(FP32).abs() @ _to_cpu(qw).dequantize(FP32).abs().t()
    assert bool(((out.float().cpu() - ref).abs() <= bound * 2**-9 + 2**-20).all())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_split.split_linear(x, qw, pow2_scales=False)
    for _ in range(3):  # each replay's folding programs leave their counters at zero
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, out)
    assert int(triton_split.prepare(x.device).count_nonzero()) == 0


def _to_cpu(q):
    return type(q)(q.data.cpu(), q.scale_inv.cpu(), q.block, q.fmt, q.pow2_scales)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv", "down"])
def test_gpu_the_l2_prefetch_variant_gives_the_same_bits(monkeypatch, name):
    """`SPLIT_PREFETCH` (a sweep variant; the interpreter cannot run its inline assembly) at the
    decode sizes, fused and unfused quantization, FP32 scales (the sweep's mode, whose kernels
    the carried census cache holds): the default's bits. Last in this module with the PDL test:
    a fault in either variant would poison the process's CUDA context for the tests after it."""
    n, k = QWEN3_8B[name]
    x, qx, qw = _operands(64, n, k, pow2=False, seed=13, device="cuda")
    for m in (1, 17, 64):
        monkeypatch.setattr(triton_split, "SPLIT_PREFETCH", False)
        want = [triton_split.split_linear(x[:m], qw, pow2_scales=False),
                triton_split.split_gemm(_rows(qx, m), qw)]  # fmt: skip
        monkeypatch.setattr(triton_split, "SPLIT_PREFETCH", True)
        got = [triton_split.split_linear(x[:m], qw, pow2_scales=False),
               triton_split.split_gemm(_rows(qx, m), qw)]  # fmt: skip
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (name, m)


@pytest.mark.gpu
def test_gpu_dependent_launches_read_what_the_kernel_before_wrote(monkeypatch):
    """`SPLIT_PDL` (a sweep variant: a programmatic dependent launch whose programs may start
    while the kernel before drains, and wait for its writes before any load): four GEMMs in a
    chain, each reading the output the one before wrote, at the decode sizes (fused and
    unfused quantization, split mode), FP32 scales, eager and replayed from a CUDA graph, give
    the bits of the same chain launched plainly. A wait after a load would read a previous
    output (a race: it shows as other bits on some replay)."""
    g = torch.Generator("cuda").manual_seed(14)
    raw = [(torch.randn(4096, 4096, generator=g, device="cuda") * 0.02).to(BF16) for _ in range(4)]
    ws = [quantize_blockwise(w, (128, 128), pow2_scales=False) for w in raw]
    x = torch.randn(64, 4096, generator=g, device="cuda").to(BF16)

    def chain(h):
        for w in ws:
            h = triton_split.split_linear(h, w, pow2_scales=False)
        return h

    for m in (1, 17, 64):
        monkeypatch.setattr(triton_split, "SPLIT_PDL", False)
        want = chain(x[:m])
        assert bool(want.isfinite().all()) and float(want.abs().max()) > 0
        monkeypatch.setattr(triton_split, "SPLIT_PDL", True)
        assert torch.equal(chain(x[:m]), want), m
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = chain(x[:m])
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(got, want), m
