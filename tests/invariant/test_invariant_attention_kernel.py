"""The invariant attention kernel: a query's output has the same bits in a decode step over a KV
cache (one query, keys 0..t) as in a prefill over the whole sequence (a causal mask), at any batch
size, and stays within a stated bound of float64. A key-chunk width chosen from the number of
queries (the planted bug) fails the same check.

Runs in Triton's CPU interpreter without a GPU (small shapes, 16-wide tiles so a 40-key sequence
spans three key chunks); realistic sizes are in test_invariant_kernels_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from invariant_checks import bits, same_bits

from nemo_jetrl.invariant import dispatch, ops
from nemo_jetrl.invariant.kernels import attention as ka

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H, T, D = 2, 2, 40, 16
SCALE = D**-0.5
TILES = {"block_m": 16, "block_n": 16}
# chunk edges (15|16, 31|32) and both ends
POSITIONS = (0, 15, 16, 31, 32, 39)
NEG = torch.finfo(torch.bfloat16).min  # HF's additive mask value for a bf16 model


def _qkv(dtype, seed=0, b=B, t=T):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, H, t, D, generator=g).to(dtype).to(DEVICE) for _ in range(3)]


def _mask(pad: list[int], t: int = T) -> torch.Tensor:
    """HF-style additive mask ``[b, 1, t, t]``: causal, plus ``pad[i]`` left-padded keys."""
    causal = torch.full((t, t), NEG).triu(1)
    m = causal.expand(len(pad), 1, t, t).clone()
    for i, p in enumerate(pad):
        m[i, :, :, :p] = NEG
    return m.to(DEVICE)


def _decode_variance(q, k, v, mask, positions, pad, **tiles) -> list[tuple[int, int]]:
    """``(row, t)`` whose decode-step output (keys 0..t, the mask's row t) differs from the
    prefill's row t in any bit. Padding queries (``t < pad[row]``: every key masked, output
    discarded) are not compared: a fully masked row's softmax spreads over whatever keys it
    sees, in either path of `ops`."""
    full = ka.attention(q, k, v, mask, SCALE, **tiles)
    bad = []
    for t in positions:
        step = ka.attention(
            q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], mask[..., t : t + 1, : t + 1],
            SCALE, **tiles,
        )  # fmt: skip
        bad += [
            (i, t)
            for i in range(q.shape[0])
            if t >= pad[i] and not same_bits(step[i, :, 0], full[i, :, t])
        ]
    return bad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_steps_have_the_prefill_bits_with_left_padding(dtype):
    q, k, v = _qkv(dtype)
    pad = [0, 5]  # row 1 is left-padded by 5 keys
    assert _decode_variance(q, k, v, _mask(pad), POSITIONS, pad, **TILES) == []


def test_a_sequence_has_the_same_bits_alone_and_in_a_batch():
    q, k, v = _qkv(torch.bfloat16, b=3)
    mask = _mask([0, 5, 2])
    full = ka.attention(q, k, v, mask, SCALE, **TILES)
    for m in (1, 2):
        assert same_bits(ka.attention(q[:m], k[:m], v[:m], mask[:m], SCALE, **TILES), full[:m])
    flip = torch.tensor([2, 1, 0], device=DEVICE)
    assert same_bits(
        ka.attention(q[flip], k[flip], v[flip], mask[flip], SCALE, **TILES), full[flip]
    )


def test_default_tiles_decode_matches_prefill_across_a_chunk_edge():
    # the launch constants as shipped (64 x 64): 70 keys span two chunks
    q, k, v = _qkv(torch.bfloat16, b=1, t=70)
    assert _decode_variance(q, k, v, _mask([0], 70), (0, 63, 64, 69), [0]) == []


def test_a_key_chunk_chosen_from_the_number_of_queries_fails_decode_vs_prefill():
    # The planted bug: decode steps walk 16-key chunks, prefills 32-key ones.
    q, k, v = _qkv(torch.float32)
    mask = _mask([0, 5])
    full = ka.attention(q, k, v, mask, SCALE, block_m=16, block_n=32)
    t = 39
    step = ka.attention(
        q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], mask[..., t : t + 1, : t + 1],
        SCALE, **TILES,
    )  # fmt: skip
    assert not same_bits(step[:, :, 0], full[:, :, t])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_within_bound_of_float64(dtype):
    q, k, v = _qkv(dtype)
    mask = _mask([0, 5])
    got = ka.attention(q, k, v, mask, SCALE, **TILES).double().cpu()
    ref = ka.attention_reference(q, k, v, mask, SCALE).cpu()
    scores = (q.double() @ k.double().transpose(-1, -2)).cpu() * SCALE + mask.double().cpu()
    weight = torch.softmax(scores, -1) @ v.double().abs().cpu()  # sum_j p_j |v_j|
    # bf16: each probability is rounded to bf16 before the product, as eager attention rounds
    # it: 2**-8 relative on a GPU (nearest), 2**-7 in the interpreter (its bf16 cast
    # truncates); fp32: the online softmax's few roundings per key chunk
    rel = (2.0**-8 if DEVICE == "cuda" else 2.0**-7) if dtype == torch.bfloat16 else 2.0**-20
    ok = (got - ref).abs() <= rel * weight + 1e-6
    ok[1, :, :5] = True  # row 1's padding queries: every key masked, output discarded
    assert ok.all(), float(((got - ref).abs() - rel * weight)[~ok].max())


def test_ops_attention_takes_the_kernel_and_keeps_its_gradient():
    q, k, v = (t.requires_grad_() for t in _qkv(torch.float32, b=1, t=20))
    mask = _mask([0], 20)
    g = torch.randn(1, 20, H, D, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with dispatch.use_kernels("triton"):
        out_k, probs_k = ops.attention(q, k, v, mask, SCALE)
        grads_k = torch.autograd.grad((out_k * g).sum(), (q, k, v))
    with dispatch.use_kernels("torch"):
        out_t, probs_t = ops.attention(q, k, v, mask, SCALE)
        grads_t = torch.autograd.grad((out_t * g).sum(), (q, k, v))
    assert probs_k is None and probs_t is not None
    direct = ka.attention(q.detach(), k.detach(), v.detach(), mask, SCALE).transpose(1, 2)
    assert torch.equal(bits(out_k), bits(direct.contiguous()))
    assert torch.allclose(out_k, out_t, atol=1e-6)
    for a, b in zip(grads_k, grads_t, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_no_mask_and_empty_inputs():
    # mask None (HAS_MASK off): every key visible; a row alone has the batch's bits
    q, k, v = _qkv(torch.float32, b=2, t=20)
    full = ka.attention(q, k, v, None, SCALE, **TILES)
    assert same_bits(ka.attention(q[1:], k[1:], v[1:], None, SCALE, **TILES), full[1:])
    ref = ka.attention_reference(q, k, v, None, SCALE).cpu()
    assert (full.double().cpu() - ref).abs().max() <= 1e-6
    empty = ka.attention(q[:, :, :0], k, v, None, SCALE)
    assert empty.shape == (2, H, 0, D)
