"""The invariant Triton kernels compiled on a GPU at a model's sizes (hidden 4096, vocabulary
151936, 2048 tokens, head dim 128): a row's bits at batch sizes 1..2048 and reversed, decode steps
equal to the prefill, and each kernel within its float64 bound. `gpu`: skipped without CUDA (the
interpreter runs the same checks at small sizes in test_invariant_kernels.py and
test_invariant_attention_kernel.py). Realistic-size planted variants must fail too: that the GPU's
tl.dot and reductions order a row the same way wherever it sits is what these tests measure. A
planted check asserts that some row's bits move, never which (FMA contraction and ex2/lg2.approx
decide that); the matmul's plant splits K (an MMA chain does not see a K step's width). Attention
compiles at head_dim 64/128/256 in bf16 and fp32 (the stages `attention_stages` picks fit
Hopper's shared memory); each stage count is a kernel of its own bits, in which a decode step
equals the prefill.
"""

from __future__ import annotations

import pytest
import torch
from invariant_checks import batch_variance, same_bits

from nemo_jetrl.invariant.kernels import attention as ka
from nemo_jetrl.invariant.kernels import matmul as km
from nemo_jetrl.invariant.kernels import rows

pytestmark = [pytest.mark.gpu, pytest.mark.triton]
SIZES = (1, 3, 8, 17, 1000)
U32 = 2.0**-24
VOCAB = 151936
NEG = torch.finfo(torch.bfloat16).min


def _rand(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_rstd_at_hidden_4096(dtype):
    x = _rand(2048, 4096, dtype=dtype, scale=3.0)
    assert batch_variance(lambda t: rows.rms_rstd(t, 1e-6), x, SIZES) == []
    ref = rows.rms_rstd_reference(x, 1e-6)
    assert ((rows.rms_rstd(x, 1e-6).double() - ref).abs() / ref).max() <= 16 * U32
    planted = batch_variance(
        lambda t: rows.rms_rstd(t, 1e-6, block=256 if len(t) < 2048 else 1024), x, SIZES
    )
    assert planted, "a lane count chosen from M left every row's bits unchanged"


def test_log_softmax_and_token_logprob_at_vocab_151936():
    x = _rand(64, VOCAB, scale=5.0)

    def lsm(t):
        mx, log_sum = rows.logsumexp_parts(t)
        return (t - mx) - log_sum

    assert batch_variance(lsm, x, (1, 3, 8, 17)) == []
    planted = batch_variance(
        lambda t: rows.logsumexp_parts(t, block=256 if len(t) < 64 else 1024)[1], x, (1, 3, 8, 17)
    )
    assert planted, "a lane count chosen from M left every row's log-sum-exp unchanged"
    ref = rows.log_softmax_reference(x)
    err = (lsm(x).double() - ref).abs()
    # tl.exp / tl.log compile to ex2.approx / lg2.approx (~2 ulp): a looser floor than on CPU
    bound = 4 * U32 * ref.abs() + 4e-6
    assert (err <= bound).all(), float((err - bound).max())
    # the chosen token's logprob from the row statistics alone: the same bits as the full row's
    ids = torch.randint(
        0, VOCAB, (64, 1), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    mx, log_sum = rows.logsumexp_parts(x)
    assert same_bits((x.gather(-1, ids) - mx) - log_sum, lsm(x).gather(-1, ids))


def test_lm_head_matmul_bf16_at_vocab_151936():
    x, w = _rand(2048, 896, dtype=torch.bfloat16), _rand(VOCAB, 896, dtype=torch.bfloat16, seed=1)
    assert batch_variance(lambda t: km.matmul(t, w), x, SIZES) == []
    pick = torch.tensor([0, 1000, 2047], device="cuda")
    got, ref = km.matmul(x[pick], w).double(), km.matmul_reference(x[pick], w)
    # 2x the fp32 gamma_K: tensor cores may truncate inside their fp32 accumulation
    bound = 2 * (896 + 1) * U32 * (x[pick].double().abs() @ w.double().abs().t())
    assert ((got - ref).abs() <= bound).all()

    def split_k(t):  # the planted bug: small batches split K in two (cuBLAS's small-M choice)
        if len(t) == len(x):
            return km.matmul(t, w)
        return km.matmul(t[:, :448], w[:, :448]) + km.matmul(t[:, 448:], w[:, 448:])

    assert batch_variance(split_k, x, SIZES), "a K split chosen from M left every row unchanged"


def test_router_and_square_matmuls_fp32_and_bf16():
    for dtype, n, k in ((torch.float32, 64, 896), (torch.bfloat16, 4096, 4096)):
        x, w = _rand(2048, k, dtype=dtype), _rand(n, k, dtype=dtype, seed=1)
        assert batch_variance(lambda t, w=w: km.matmul(t, w), x, SIZES) == [], (dtype, n, k)
        got, ref = km.matmul(x[:17], w).double(), km.matmul_reference(x[:17], w)
        bound = 2 * (k + 1) * U32 * (x[:17].double().abs() @ w.double().abs().t())
        assert ((got - ref).abs() <= bound).all(), (dtype, n, k)


def _attention_case(b=2, h=16, t=2048, d=128, pad=(0, 100)):
    q, k, v = (_rand(b, h, t, d, dtype=torch.bfloat16, seed=s) for s in range(3))
    mask = torch.full((t, t), NEG, device="cuda").triu(1).expand(b, 1, t, t).clone()
    for i, p in enumerate(pad):
        mask[i, :, :, :p] = NEG
    return q, k, v, mask, d**-0.5


def _step(q, k, v, mask, scale, t, **tiles):
    sl = slice(t, t + 1)
    return ka.attention(
        q[:, :, sl], k[:, :, : t + 1], v[:, :, : t + 1], mask[..., sl, : t + 1], scale, **tiles
    )


def test_attention_decode_equals_prefill_at_seq_2048_head_dim_128():
    q, k, v, mask, scale = _attention_case()
    full = ka.attention(q, k, v, mask, scale)
    for t in (100, 127, 128, 1000, 2047):  # row 1's first real query, chunk edges, the end
        assert same_bits(_step(q, k, v, mask, scale, t)[:, :, 0], full[:, :, t]), t
    assert same_bits(ka.attention(q[:1], k[:1], v[:1], mask[:1], scale), full[:1])
    ref = ka.attention_reference(q[:1, :2], k[:1, :2], v[:1, :2], mask[:1], scale)
    p = torch.softmax(
        (q[:1, :2].double() @ k[:1, :2].double().transpose(-1, -2)) * scale + mask[:1].double(), -1
    )
    bound = 2.0**-8 * (p @ v[:1, :2].double().abs()) + 1e-6
    assert ((full[:1, :2].double() - ref).abs() <= bound).all()
    planted = _step(q, k, v, mask, scale, 2047, block_n=32)[:, :, 0]
    assert not same_bits(planted, full[:, :, 2047]), (
        "a key chunk chosen from Tq left the bits unchanged"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_attention_compiles_at_head_dim_64_128_256_and_decode_equals_prefill_at_each_stage_count(
    d, dtype
):
    """The rule's stages (fp32 at head_dim 256: 1; 2 elsewhere) and 1 stage: each a kernel of its
    own. On the H200 (runs 7 and 8) 1 and 2 stages gave other bits for bf16 at 64/128/256 and
    fp32 at 128, fp fusion off or on, so the stage count is fixed by head dim and dtype
    (`attention_stages`), and within one count a decode step equals the prefill."""
    q, k, v, mask, scale = _attention_case(b=1, h=4, t=300, d=d, pad=(20,))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    for stages in sorted({ka.attention_stages(d, dtype.itemsize), 1}):
        full = ka.attention(q, k, v, mask, scale, num_stages=stages)
        if stages == ka.attention_stages(d, dtype.itemsize):
            assert same_bits(ka.attention(q, k, v, mask, scale), full)  # the default is the rule
        for t in (20, 63, 64, 299):
            step = _step(q, k, v, mask, scale, t, num_stages=stages)[:, :, 0]
            assert same_bits(step, full[:, :, t]), (d, dtype, stages, t)


def test_rotary_embedding_of_a_decode_step_equals_the_prefills():
    """RoPE as the local backend runs it on a GPU (`invariant.hf.RotaryTable`: cos/sin made once
    by the model's own rotary, then transformers' ``apply_rotary_pos_emb``, elementwise torch
    ops): a position's rotated q and k have the same bits alone (a decode step) and inside a
    2048-token prefill."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    from nemo_jetrl.invariant.hf import RotaryTable

    cfg = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=16, head_dim=128,
                                   max_position_embeddings=4096, rope_theta=1e6)  # fmt: skip
    table = RotaryTable(modeling_llama.LlamaRotaryEmbedding(cfg).cuda(), 4096)
    q, k = (_rand(1, 16, 2048, 128, dtype=torch.bfloat16, seed=s) for s in (1, 2))
    pos = torch.arange(2048, device="cuda")[None]
    cos, sin = table(q, pos)
    q_all, k_all = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    for t in (0, 1, 63, 64, 2047):
        c, s_ = table(q, pos[:, t : t + 1])
        q_t, k_t = modeling_llama.apply_rotary_pos_emb(
            q[:, :, t : t + 1], k[:, :, t : t + 1], c, s_
        )
        assert same_bits(q_t, q_all[:, :, t : t + 1]) and same_bits(k_t, k_all[:, :, t : t + 1]), t
