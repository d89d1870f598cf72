"""The serving MoE layer at prefill sizes (issue 48): what one call does on the host, and bits that
do not depend on the grouped GEMM's program shape.

Structure (Triton's CPU interpreter; conftest sets TRITON_INTERPRET=1): one layer call at 2048
tokens counts its torch ops outside the kernels, its launches, allocations and host reads as
literals. The grouped GEMM makes its tile schedule on the device: before, each `gemm_rows` call
ran 8 more torch ops for it (two slices, sub, add, floor_divide, new_zeros, cumsum, cat), and the
combine built its row table in 8 more (gather, searchsorted, 2 arange, gather, sub, full,
index_put_) where every token has its k rows: the layer call ran 64 ops, then 48, now 40
(measured here with the same counter; 6 of them run a kernel on a GPU, 15 did).

Bits: `gemm_rows` under every `grouped_tiles.ROWS_TILES` shape (64/128-row tiles, one tile per
program or a persistent grid) equals the per-expert reference bit for bit on integer-valued
inputs (every 128-wide tile's dot exact in fp32) and each other on random values, with experts
of 0, 1, 127, 129 tokens; the whole layer under a forced shape equals the training forward.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton_setup import DEVICE, TRITON_MARKS

from nemo_jetrl.fp8 import experts, experts_reference, finite_flags, grouped_tiles, triton_grouped
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.experts_layer import combine, routed_experts_inference, sort_routes
from nemo_jetrl.fp8.formats import E4M3, E5M2
from nemo_jetrl.fp8.silu_mul import silu_mul
from nemo_jetrl.fp8.sync_check import no_host_reads

pytestmark = TRITON_MARKS
COUNTS = [0, 1, 127, 129, 300, 0, 64, 200]  # 821 routed rows over 8 experts
ALLOCS = {"aten.empty", "aten.new_empty", "aten.full", "aten.zeros", "aten.new_zeros"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a, b) -> bool:
    return torch.equal(_bits(a), _bits(b))


def _offsets(counts):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device=DEVICE)


class _HostCount(TorchDispatchMode):
    """aten ops the host runs around the kernels (the interpreter's own copies excluded)."""

    def __init__(self, launches: collections.Counter, inside: list[bool]):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.launches, self.inside = launches, inside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside[0]:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """(launches by kernel, grids by kernel, inside flag) with the interpreter's launch hooked."""
    from triton.runtime import interpreter

    launches: collections.Counter = collections.Counter()
    grids: dict[str, list] = collections.defaultdict(list)
    inside = [False]
    original = interpreter.GridExecutor.__call__

    def call(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        grids[self.fn.__name__].append(tuple(self.grid))
        inside[0] = True
        try:
            return original(self, *args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", call)
    return launches, grids, inside


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the interpreter's host path (CPU)")
def test_one_prefill_layer_call_runs_these_ops_launches_and_no_host_read(monkeypatch, counted):
    launches, grids, inside = counted
    monkeypatch.setenv(experts.ENV_GROUPED_BACKEND, "triton")
    monkeypatch.delenv(grouped_tiles.ENV_ROWS_TILE, raising=False)
    monkeypatch.setattr(finite_flags, "sync_free", lambda t: True)  # CUDA's deferred checks
    t, h, inter, n_exp, k = 2048, 128, 128, 8, 2
    g = torch.Generator().manual_seed(0)
    cfg = Fp8LinearConfig.te_blockwise()
    q13 = experts.quantize_expert_weights(torch.randn(n_exp, 2 * inter, h, generator=g), cfg, "m")
    q2 = experts.quantize_expert_weights(torch.randn(n_exp, h, inter, generator=g), cfg, "m")
    x = torch.randn(t, h, generator=g).bfloat16()
    ids, w = torch.randint(0, n_exp, (t, k), generator=g), torch.rand(t, k, generator=g)

    def layer(x, ids, w):
        order, token, offsets = sort_routes(ids, n_exp)
        y = routed_experts_inference(x, token, offsets, q13, q2, cfg, "m", check_finite=False)
        return combine(y, token, w.reshape(-1)[order], x.shape[0], k, x.dtype)

    layer(x[:64], ids[:64], w[:64])  # value tables and kernels made once, outside the count
    launches.clear()
    grids.clear()
    assert grouped_tiles.rows_tile(t * k, n_exp) == "p128"  # 4096 rows >= 128 * 8 experts
    with no_host_reads(), _HostCount(launches, inside) as mode:
        layer(x, ids, w)
    assert dict(launches) == {
        "quantize_kernel": 1,
        "grouped_rows_gemm_kernel": 2,
        "silu_mul_quantize_kernel": 1,
        "combine_kernel": 1,
    }
    # The persistent grid: INTERPRETER_PROGRAMS programs loop over 4096/128 + 8 row tiles at most.
    assert grids["grouped_rows_gemm_kernel"] == [(3,), (3,)]
    assert dict(mode.ops) == {
        # sort_routes: reshape, sort (the sorted ids and the order), arange, searchsorted,
        # order // k; the test's w[order]; combine: argsort, then its [T, k] row table is that
        # order viewed (every token has its k rows: before, 8 more ops built it)
        "aten.view": 14,  # reshapes and the uint8/int16 views the interpreter's kernels take
        "aten.detach": 10,  # dtype views (view.dtype goes through detach)
        "aten.sort": 2,
        "aten.arange": 1,
        "aten.index": 1,
        "aten.searchsorted": 1,
        "aten.floor_divide": 1,
        "aten.empty": 7,  # codes and scales (2 quantizations), 2 GEMM outputs, the combine's
        "aten.new_empty": 1,  # the input check's shape-only rows
        "aten._to_copy": 2,  # fp32 -> bf16 of the GEMM outputs: the interpreter only
    }
    assert sum(n for op, n in mode.ops.items() if op in ALLOCS) == 8
    assert sum(mode.ops.values()) == 40


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the interpreter's host path (CPU)")
@pytest.mark.parametrize("tile", ["p128", "p128t"])  # TMA descriptors are host metadata only
def test_gemm_rows_runs_no_torch_op_for_its_tile_schedule(counted, monkeypatch, tile):
    monkeypatch.setenv(grouped_tiles.ENV_ROWS_TILE, tile)
    launches, _, inside = counted
    offsets = _offsets(COUNTS)
    g = torch.Generator().manual_seed(1)
    kw = {"pow2_scales": True, "eps": 0.0, "name": "moe"}
    x = torch.randn(sum(COUNTS), 128, generator=g)
    qx = experts_reference.quantize_rows(x, offsets, fmt=E4M3, what="input", **kw)
    qw, _ = experts_reference.quantize_experts(
        torch.randn(8, 128, 128, generator=g), fmt=E4M3, **kw
    )
    triton_grouped.gemm_rows(qx, qw, offsets, out_dtype=torch.bfloat16, exact=True)  # warm-up
    with no_host_reads(), _HostCount(launches, inside) as mode:
        triton_grouped.gemm_rows(qx, qw, offsets, out_dtype=torch.bfloat16, exact=True)
    # The output, the two uint8 views of the value-table path and the interpreter's fp32 ->
    # bf16 rounding; on a GPU only the output (FP8 pointers, bf16 stored by the kernel).
    assert dict(mode.ops) == {"aten.empty": 1, "aten.view": 2, "aten.detach": 2, "aten._to_copy": 1}


def test_every_tile_shape_gives_the_reference_bits(monkeypatch):
    """FP32 scales (pow2 ones are exact in every order: the harder case), FProp, DGrad on the
    transposed view (E5M2 x E4M3) and the serving gather."""
    monkeypatch.setattr(triton_grouped, "native_dot", lambda fmts, capability: False)
    g = torch.Generator().manual_seed(2)
    offsets, m = _offsets(COUNTS), sum(COUNTS)
    kw = {"pow2_scales": False, "eps": 0.0, "name": "moe"}
    x = torch.randint(-16, 17, (m, 128), generator=g).bfloat16().to(DEVICE)
    dy = (torch.randint(-16, 17, (m, 256), generator=g) * 8).bfloat16().to(DEVICE)
    w = torch.randint(-16, 17, (8, 256, 128), generator=g).float().to(DEVICE)  # DGrad: 2 K tiles
    qx = experts_reference.quantize_rows(x, offsets, fmt=E4M3, what="input", **kw)
    qdy = experts_reference.quantize_rows(dy, offsets, fmt=E5M2, what="grad_output", **kw)
    qw, qwt = experts_reference.quantize_experts(w, fmt=E4M3, **kw)
    token = torch.randint(0, m, (m,), generator=g).to(DEVICE)  # the serving gather
    cases = [(qx, qw, None), (qdy, qwt, None), (qx, qw, token)]
    for a, b, rows in cases:
        want = experts_reference.gemm_rows(
            a, b, offsets, out_dtype=torch.bfloat16, exact=True, rows=rows
        )
        assert bool(want.float().abs().sum() > 0)
        for name in grouped_tiles.ROWS_TILES:
            monkeypatch.setenv(grouped_tiles.ENV_ROWS_TILE, name)
            got = triton_grouped.gemm_rows(
                a, b, offsets, out_dtype=torch.bfloat16, exact=True, rows=rows
            )
            assert _same(got, want), (name, rows is None)


@pytest.mark.skipif(DEVICE == "cuda", reason="interpreter dots (exact per tile shape)")
def test_tile_shapes_agree_on_random_values_and_token_counts():
    """Random values (tile dots rounded in fp32): every shape the same bits at several counts,
    the expert sizes 0, 1, 127, 129 among them, and a batch too small to fill the grid."""
    g = torch.Generator().manual_seed(3)
    kw = {"pow2_scales": False, "eps": 0.0, "name": "moe"}
    w = torch.randn(8, 128, 256, generator=g)  # 2 K tiles: the prefetched scales are used
    qw, _ = experts_reference.quantize_experts(w, fmt=E4M3, **kw)
    for counts in (COUNTS, [1, 0, 0, 0, 0, 0, 0, 0], [129, 127, 1, 0, 0, 0, 0, 513]):
        offsets = _offsets(counts)
        x = torch.randn(sum(counts), 256, generator=g).bfloat16()
        qx = experts_reference.quantize_rows(x, offsets, fmt=E4M3, what="input", **kw)
        outs = {}
        for name in grouped_tiles.ROWS_TILES:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(grouped_tiles.ENV_ROWS_TILE, name)
                outs[name] = triton_grouped.gemm_rows(
                    qx, qw, offsets, out_dtype=torch.bfloat16, exact=False
                )
        first = outs.pop("d64")
        assert bool(first.float().abs().sum() > 0)
        assert all(_same(first, o) for o in outs.values()), counts


@pytest.mark.parametrize("tile", ["p128", "p64"])
def test_layer_under_a_forced_prefill_shape_gives_the_training_forwards_bits(monkeypatch, tile):
    monkeypatch.setenv(experts.ENV_GROUPED_BACKEND, "triton")
    monkeypatch.setattr(triton_grouped, "native_dot", lambda fmts, capability: False)
    monkeypatch.setenv(grouped_tiles.ENV_ROWS_TILE, tile)
    g = torch.Generator().manual_seed(4)
    n_exp, h, inter, t, k = 5, 128, 128, 150, 2
    cfg = Fp8LinearConfig(pow2_scales=True, exact_gemm=True)
    w13 = torch.randint(-4, 5, (n_exp, 2 * inter, h), generator=g).bfloat16().to(DEVICE)
    w2 = torch.randint(-4, 5, (n_exp, h, inter), generator=g).bfloat16().to(DEVICE)
    x = torch.randint(-4, 5, (t, h), generator=g).bfloat16().to(DEVICE)
    ids = torch.stack([torch.randperm(n_exp - 1, generator=g)[:k] for _ in range(t)]).to(DEVICE)
    w = torch.rand(t, k, generator=g).to(DEVICE)
    q13 = experts.quantize_expert_weights(w13, cfg, "l")
    q2 = experts.quantize_expert_weights(w2, cfg, "l")
    order, token, offsets = sort_routes(ids, n_exp)
    assert offsets[-1] - offsets[-2] == 0  # expert 4 is never routed
    y = routed_experts_inference(x, token, offsets, q13, q2, cfg, "l")
    got = combine(y, token, w.reshape(-1)[order], t, k, x.dtype)
    monkeypatch.setenv(experts.ENV_GROUPED_BACKEND, "torch")
    with torch.no_grad():
        gate, up = experts.grouped_fp8_linear(x[token], w13, offsets, cfg, "l").chunk(2, -1)
        y_train = experts.grouped_fp8_linear(silu_mul(gate, up), w2, offsets, cfg, "l")
    want = combine(y_train, token, w.reshape(-1)[order], t, k, x.dtype)
    assert _same(got, want) and bool(want.float().abs().sum() > 0)
    finite_flags._FLAGS.clear()


def test_the_gemm_module_uses_ieee_division_only():
    """`test_triton_kernels`' rule for every jitted module (fp32 `/` is approximate on NVIDIA
    GPUs and the interpreter cannot show it), for the module this kernel moved to."""
    import ast
    from pathlib import Path

    from nemo_jetrl.fp8 import _triton_grouped_gemm_jit as jit

    tree = ast.parse(Path(jit.__file__).read_text())
    kernels = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("jit" in ast.unparse(d) for d in node.decorator_list)
    ]
    assert [k.name for k in kernels] == [
        "_expert_tiles",
        "_a_tile",
        "_b_tile",
        "grouped_rows_gemm_kernel",
    ]
    for fn in kernels:
        divs = [n for n in ast.walk(fn) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)]
        assert not divs, f"{fn.name}: '/' at line {divs[0].lineno}"


def test_launch_arguments_fit_the_direct_launcher(monkeypatch):
    """`triton_launch.launch` calls a compiled kernel's launcher with ``args`` and then the
    values of every later parameter taken from ``meta``: each layer launch passes exactly the
    kernel's non-constexpr parameters positionally and names all the rest (CPU: checked here,
    then launched through Triton as the interpreter does)."""
    import inspect

    from nemo_jetrl.fp8 import triton_launch

    seen: list[str] = []

    def spy(kernel, grid, args, meta):
        params = inspect.signature(kernel.fn).parameters.values()
        positional = [p.name for p in params if "constexpr" not in str(p.annotation)]
        assert list(kernel.arg_names[: len(args)]) == positional, kernel.__name__
        assert set(kernel.arg_names[len(args) :]) <= set(meta), kernel.__name__
        assert isinstance(meta, triton_launch.LaunchMeta)  # keyed once, not hashed per call
        seen.append(kernel.__name__)
        kernel[grid](*args, **meta)

    monkeypatch.setattr(triton_grouped, "launch", spy)
    monkeypatch.setenv(experts.ENV_GROUPED_BACKEND, "triton")
    g = torch.Generator().manual_seed(5)
    cfg = Fp8LinearConfig.te_blockwise()
    q13 = experts.quantize_expert_weights(
        torch.randn(3, 256, 128, generator=g).to(DEVICE), cfg, "m"
    )
    q2 = experts.quantize_expert_weights(torch.randn(3, 128, 128, generator=g).to(DEVICE), cfg, "m")
    x = torch.randn(40, 128, generator=g).bfloat16().to(DEVICE)
    ids = torch.randint(0, 3, (40, 2), generator=g).to(DEVICE)
    order, token, offsets = sort_routes(ids, 3)
    y = routed_experts_inference(x, token, offsets, q13, q2, cfg, "m", check_finite=False)
    combine(y, token, torch.rand(80, generator=g).to(DEVICE)[order], 40, 2, x.dtype)
    finite_flags._FLAGS.clear()
    assert seen == [
        "grouped_rows_gemm_kernel",
        "silu_mul_quantize_kernel",
        "grouped_rows_gemm_kernel",
        "combine_kernel",
    ]


@pytest.mark.gpu
def test_direct_launches_give_the_layers_triton_launch_bits_on_a_gpu(monkeypatch):
    """Compiled kernels: the prefill layer through direct launches (second call of each
    specialisation) gives the bits of launches through Triton, at the default shape and at
    a TMA shape (descriptors always go through Triton)."""
    from nemo_jetrl.fp8 import triton_launch

    g = torch.Generator().manual_seed(6)
    cfg = Fp8LinearConfig.te_blockwise()
    n_exp, t, k = 8, 2048, 2
    q13 = experts.quantize_expert_weights(torch.randn(n_exp, 1536, 1024, generator=g).cuda(), cfg)
    q2 = experts.quantize_expert_weights(torch.randn(n_exp, 1024, 768, generator=g).cuda(), cfg)
    x = torch.randn(t, 1024, generator=g).bfloat16().cuda()
    ids = torch.randint(0, n_exp, (t, k), generator=g).cuda()
    w = torch.rand(t * k, generator=g).cuda()

    def layer():
        order, token, offsets = sort_routes(ids, n_exp)
        y = routed_experts_inference(x, token, offsets, q13, q2, cfg, "m", check_finite=False)
        return combine(y, token, w[order], t, k, x.dtype)

    outs = {}
    for tile in ("auto", "p128t"):
        monkeypatch.setenv(grouped_tiles.ENV_ROWS_TILE, tile)
        layer()
        outs[tile] = layer()  # direct where the kernel allows it
        assert triton_launch.direct_launch_status()[0] is True, triton_launch.direct_launch_status()
    monkeypatch.setitem(triton_launch._DIRECT, "on", False)
    for tile in ("auto", "p128t"):
        monkeypatch.setenv(grouped_tiles.ENV_ROWS_TILE, tile)
        assert _same(layer(), outs[tile]), tile
    assert _same(outs["auto"], outs["p128t"])  # and the shapes agree on the GPU too
