"""The serving MoE layer (`fp8.experts_layer`): quantize the tokens once and gather FP8 rows, SiLU*up
fused with the down projection's quantization (`fp8.silu_mul`'s rule), a fixed-order combine.

Bits are compared bit for bit: the once-quantized gathered rows with the gathered copy quantized;
the fused layer with today's unfused path (`grouped_fp8_linear_inference` on ``x[token]``, SiLU*up,
`grouped_fp8_linear_inference`) and with the training forward (`grouped_fp8_linear`), on the
reference and on the Triton path (its CPU interpreter here: conftest sets TRITON_INTERPRET=1); the
fused Triton kernel with its pure-torch reference; the SiLU rule with the local backend's
batch-invariant ``ops.silu`` on every bf16 pattern; a token's combined output alone, reordered
and inside other batches.
"""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.fp8 import experts, experts_reference, finite_flags, triton_grouped
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.dispatch import quantize_blockwise
from nemo_jetrl.fp8.experts import grouped_fp8_linear, grouped_fp8_linear_inference
from nemo_jetrl.fp8.experts_layer import combine, routed_experts_inference, sort_routes
from nemo_jetrl.fp8.formats import E4M3
from nemo_jetrl.fp8.silu_mul import portable_exp, silu_mul, silu_mul_quantize_reference
from nemo_jetrl.invariant import ops as iops

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, H, INTER, TOPK = 5, 256, 256, 2
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a, b) -> bool:
    return torch.equal(_bits(a), _bits(b))


@pytest.fixture
def backend(request, monkeypatch):
    monkeypatch.setenv(experts.ENV_GROUPED_BACKEND, request.param)
    yield request.param
    finite_flags._FLAGS.clear()


def _layer(seed: int, pow2: bool, tokens: int = 19):
    """bf16 masters, trainer-quantized copies, tokens with outlier channels, top-2 routes
    (expert 3 never chosen: an empty expert)."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * INTER, H, generator=g) * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, INTER, generator=g) * INTER**-0.5).bfloat16()
    x = torch.randn(tokens, H, generator=g) * (1 + 30 * (torch.rand(H, generator=g) > 0.97))
    scores = torch.rand(tokens, E, generator=g)
    scores[:, 3] = -1
    ids = scores.argsort(dim=1, descending=True)[:, :TOPK]
    w = torch.softmax(torch.rand(tokens, TOPK, generator=g), -1)
    cfg = Fp8LinearConfig(pow2_scales=pow2, exact_gemm=True)
    dev = {"device": DEVICE}
    w13, w2 = w13.to(**dev), w2.to(**dev)
    q13 = experts.quantize_expert_weights(w13, cfg, "l.w13")
    q2 = experts.quantize_expert_weights(w2, cfg, "l.w2")
    return x.bfloat16().to(**dev), ids.to(**dev), w.to(**dev), w13, w2, q13, q2, cfg


# ----------------------------------------------------------------------------------- the rule


def test_silu_rule_is_the_batch_invariant_silu_on_every_bf16_pattern():
    """`silu_mul` == ``invariant.ops.silu(gate) * up`` and `portable_exp` == ``ops.exp``: one
    rule written in two homes (fp8/ imports nothing else of the package)."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert _same(portable_exp(gate.float()), iops.exp(gate.float()))
    assert _same(silu_mul(gate, up), iops.silu(gate) * up)
    g16 = gate.float().clamp(-60000, 60000).half()
    assert _same(silu_mul(g16, up.half()), iops.silu(g16) * up.half())


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32_scales"])
def test_fused_silu_mul_quantize_kernel_gives_the_unfused_bits(dtype, pow2):
    """One launch == `silu_mul` (SiLU rounded to the model dtype, product rounded once) then the
    1x128 quantizer, over gates where exp overflows, underflows and rounds half-way."""
    g = torch.Generator().manual_seed(4)
    rows = 3 * 33
    scale = torch.tensor([0.01, 1.0, 8.0, 40.0])[torch.randint(0, 4, (rows, 1), generator=g)]
    gu = (torch.randn(rows, 2 * 384, generator=g) * scale).to(dtype).to(DEVICE)
    gu[5, :384] = torch.linspace(-120, 120, 384)  # exp(-gate) over/underflows at the ends
    gu[6] = 0.0  # an all-zero block: scale 1
    offsets = torch.tensor([0, 40, 40, rows], device=DEVICE)
    kw = {"fmt": E4M3, "pow2_scales": pow2, "eps": 0.0, "name": "l.w2"}
    got = triton_grouped.silu_mul_quantize(gu, offsets, **kw)
    want = silu_mul_quantize_reference(gu, **kw)
    assert got.data.shape == (rows, 384) and got.scale_inv.shape == (rows, 3)
    assert _same(got.data, want.data) and _same(got.scale_inv, want.scale_inv)
    ref = experts_reference.silu_mul_quantize(gu, offsets, **kw)  # per expert: same bits
    assert _same(ref.data, want.data) and _same(ref.scale_inv, want.scale_inv)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_non_finite_gate_up_is_named_by_expert(backend):
    gu = torch.randn(12, 512).bfloat16().to(DEVICE)
    gu[9, 300] = float("inf")
    ops = experts._ops(gu)
    offsets = torch.tensor([0, 4, 8, 12], device=DEVICE)
    kw = {"fmt": E4M3, "pow2_scales": True, "eps": 0.0, "name": "l.w2"}
    with pytest.raises(ValueError, match=r"l\.w2\.expert2\.input"):
        ops.silu_mul_quantize(gu, offsets, **kw)
    q = ops.silu_mul_quantize(gu, offsets, check_finite=False, **kw)
    assert bool(torch.isnan(q.scale_inv[9]).any()) and bool(torch.isfinite(q.scale_inv[:9]).all())


# -------------------------------------------------------------------- quantize once, gather


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32_scales"])
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_tokens_quantized_once_give_the_gathered_copys_bits(backend, pow2):
    x, ids, _, _, _, q13, _, _ = _layer(1, pow2)
    _, token, offsets = sort_routes(ids, E)
    ops = experts._ops(x)
    kw = {"fmt": E4M3, "pow2_scales": pow2, "eps": 0.0, "name": "l"}
    once = ops.quantize_input(x, **kw)
    gathered = quantize_blockwise(x[token], (1, 128), pow2_scales=pow2)
    assert _same(once.data[token], gathered.data)
    assert _same(once.scale_inv[token], gathered.scale_inv)
    got = ops.gemm_rows(once, q13, offsets, out_dtype=torch.bfloat16, exact=True, rows=token)
    want = ops.gemm_rows(gathered, q13, offsets, out_dtype=torch.bfloat16, exact=True)
    assert _same(got, want) and bool(want.float().abs().sum() > 0)


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32_scales"])
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_fused_layer_gives_the_unfused_path_and_the_training_forwards_bits(backend, pow2):
    x, ids, _, w13, w2, q13, q2, cfg = _layer(2, pow2)
    _, token, offsets = sort_routes(ids, E)
    assert offsets.tolist()[3] == offsets.tolist()[4]  # expert 3 is empty
    got = routed_experts_inference(x, token, offsets, q13, q2, cfg, "l")
    # today's path: the BF16 gather, the grouped linear, SiLU*up, the grouped linear again
    gate, up = grouped_fp8_linear_inference(x[token], q13, offsets, cfg, "l.w13").chunk(2, -1)
    want = grouped_fp8_linear_inference(silu_mul(gate, up), q2, offsets, cfg, "l.w2")
    assert got.dtype == torch.bfloat16 and _same(got, want)
    with torch.no_grad():  # the trainer: BF16 masters, quantized on the fly
        gate, up = grouped_fp8_linear(x[token], w13, offsets, cfg, "l.w13").chunk(2, -1)
        train = grouped_fp8_linear(silu_mul(gate, up), w2, offsets, cfg, "l.w2")
    assert _same(got, train)
    with pytest.raises(ValueError, match=r"l\.w13: weights quantized as e4m3/pow2"):
        other = Fp8LinearConfig(pow2_scales=not pow2, exact_gemm=True)
        routed_experts_inference(x, token, offsets, q13, q2, other, "l")


# --------------------------------------------------------------------------------- combine


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_a_tokens_output_does_not_depend_on_order_or_batch(backend):
    """Tokens 0..3 alone, reversed, and inside two larger batches give the same bits; the sum is
    in ascending expert id per token (checked against an explicit loop)."""
    x, ids, w, _, _, q13, q2, cfg = _layer(3, True, tokens=23)

    def layer(sel: torch.Tensor) -> torch.Tensor:
        order, token, offsets = sort_routes(ids[sel], E)
        y = routed_experts_inference(x[sel], token, offsets, q13, q2, cfg, "l")
        return combine(y, token, w[sel].reshape(-1)[order], sel.numel(), TOPK)

    head = torch.arange(4, device=DEVICE)
    alone = layer(head)
    assert _same(layer(head.flip(0)), alone.flip(0))
    assert _same(layer(torch.arange(23, device=DEVICE))[:4], alone)
    mixed = torch.cat([torch.arange(22, 3, -1, device=DEVICE), head])
    assert _same(layer(mixed)[-4:], alone)
    # the order: ascending expert id, fp32 products, k - 1 adds
    order, token, offsets = sort_routes(ids[head], E)
    y = routed_experts_inference(x[head], token, offsets, q13, q2, cfg, "l")
    wr = w[head].reshape(-1)[order]
    for t in range(4):
        rows = (token == t).nonzero().flatten().tolist()  # sorted by expert already
        acc = y[rows[0]].float() * wr[rows[0]]
        for r in rows[1:]:
            acc = acc + y[r].float() * wr[r]
        assert _same(alone[t], acc)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_combine_with_fewer_rows_for_some_tokens(backend):
    """Expert parallel drops a token's routes to other ranks: absent slots add nothing; a bf16
    output is the fp32 sum rounded once."""
    y = torch.randn(5, 384, generator=torch.Generator().manual_seed(5)).bfloat16().to(DEVICE)
    token = torch.tensor([0, 2, 0, 1, 2], device=DEVICE)  # token 1 has one row here
    wt = torch.tensor([0.5, 0.25, 0.125, 1.0, 2.0], device=DEVICE)
    got = combine(y, token, wt, 4, 2)  # token 3 has none: +0
    yf = y.float()
    assert _same(got[0], yf[0] * 0.5 + yf[2] * 0.125) and _same(got[1], yf[3] * 1.0)
    assert _same(got[2], yf[1] * 0.25 + yf[4] * 2.0) and _same(got[3], torch.zeros(384))
    assert _same(combine(y, token, wt, 4, 2, torch.bfloat16), got.bfloat16())


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_combine_when_this_rank_holds_no_route_at_all(backend):
    """Expert parallel: every token of a batch routed to other ranks' experts leaves this rank
    no row (y [0, H]); each token's output is +0, not an IndexError (seen on vLLM 0.32's EP=2
    engine: test_vllm_moe_shards[ep])."""
    y = torch.zeros(0, 256, dtype=torch.bfloat16, device=DEVICE)
    token = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    wt = torch.zeros(0, device=DEVICE)
    got = combine(y, token, wt, 3, 2, torch.bfloat16)
    assert got.shape == (3, 256) and _same(got.float(), torch.zeros(3, 256))
    assert not torch.signbit(got.float()).any()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_combine_sums_in_slot_order_for_any_top_k(backend):
    """k = 4 with absent slots: the kernel's sum is ((p0 + p1) + p2) + p3 in expert order."""
    g = torch.Generator().manual_seed(6)
    token = torch.tensor([2, 0, 1, 0, 2, 0, 2, 0, 2])  # sorted rows; token 1 has one row
    y = (torch.randn(9, 256, generator=g) * 100).bfloat16().to(DEVICE)
    wt = torch.rand(9, generator=g).to(DEVICE)
    got = combine(y, token.to(DEVICE), wt, 3, 4)
    p = y.float() * wt[:, None]
    for t in range(3):
        rows = (token == t).nonzero().flatten().tolist()
        acc = p[rows[0]]
        for r in rows[1:]:
            acc = acc + p[r]
        assert _same(got[t], acc), t


@pytest.mark.triton
def test_fused_kernel_matches_the_cpu_rule_on_every_bf16_gate():
    """The kernel (on a GPU compiled with enable_fp_fusion=False) == the torch rule on CPU, bit
    for bit: every finite bf16 gate pattern, |up| < 1 (no product overflows); on a GPU also the
    torch rule on CUDA == on CPU."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = torch.where(torch.isfinite(gate), gate, 0.0)
    up = (
        torch.rand(gate.shape, generator=torch.Generator().manual_seed(0)) * 1.98 - 0.99
    ).bfloat16()
    gu = torch.cat([gate.reshape(256, 256), up.reshape(256, 256)], 1)
    kw = {"fmt": E4M3, "pow2_scales": False, "eps": 0.0, "name": "l.w2", "check_finite": False}
    want = silu_mul_quantize_reference(gu, **kw)
    offsets = torch.tensor([0, 256], device=DEVICE)
    got = triton_grouped.silu_mul_quantize(gu.to(DEVICE), offsets, **kw)
    assert _same(got.data, want.data)
    assert torch.equal(got.scale_inv.cpu(), want.scale_inv)
    if DEVICE == "cuda":
        assert _same(silu_mul(gate.cuda(), up.cuda()), silu_mul(gate, up))


@pytest.mark.gpu
def test_gpu_moe_layer_reads_nothing_on_the_host_and_replays_in_a_cuda_graph():
    x, ids, w, _, _, q13, q2, cfg = _layer(7, True, tokens=64)

    def step() -> torch.Tensor:
        order, token, offsets = sort_routes(ids, E)
        y = routed_experts_inference(x, token, offsets, q13, q2, cfg, "l", check_finite=False)
        return combine(y, token, w.reshape(-1)[order], x.shape[0], TOPK, x.dtype)

    eager = step()  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert _same(again, eager) and _same(out, eager)
