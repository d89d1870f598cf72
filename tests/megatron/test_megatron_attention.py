"""Q/K/V observers and on-policy FP8 KV on a real Megatron-Core GPTModel built on CPU.

Shims for Megatron's two CUDA calls are in tests/megatron_shims.py (documented there).
"""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.kvcache import CalibrationSettings, KVScales, fake_quantize_kv, token_mask

pytestmark = pytest.mark.megatron

SEQ, BATCH = 16, 3


def _capture(model, store):
    """Independent capture of what each core attention receives (registered after ours)."""
    hs = []
    for name, mod in model.named_modules():
        if name.endswith("self_attention.core_attention"):
            layer = int(name.split(".")[2])

            def hook(m, args, layer=layer):
                store.setdefault(layer, []).append(tuple(a.detach().clone() for a in args[:3]))

            hs.append(mod.register_forward_pre_hook(hook))
    return hs


def test_hook_sees_post_norm_post_rope_qkv(gpt):
    """The tensors at core_attention are RoPE(qk_norm(split(linear_qkv(x)))), not earlier ones."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron_shims import forward

    attn = gpt.decoder.layers[1].self_attention
    seen, qkv_in = {}, []
    hs = _capture(gpt, seen)
    hs.append(attn.linear_qkv.register_forward_pre_hook(lambda m, a: qkv_in.append(a[0].clone())))
    ids = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            forward(gpt, ids)
            q0, k0, v0 = attn.get_query_key_value_tensors(qkv_in[0], None)
            freqs = gpt.rotary_pos_emb(SEQ)
            q_rope = apply_rotary_pos_emb(q0, freqs, config=gpt.config)
            k_rope = apply_rotary_pos_emb(k0, freqs, config=gpt.config)
    finally:
        for h in hs:
            h.remove()
    q, k, v = seen[1][0]
    assert q.shape == (SEQ, BATCH, 4, 64) and k.shape == (SEQ, BATCH, 2, 64)
    torch.testing.assert_close(q, q_rope, rtol=0, atol=0)
    torch.testing.assert_close(k, k_rope, rtol=0, atol=0)
    torch.testing.assert_close(v, v0, rtol=0, atol=0)
    assert not torch.equal(k, k0)  # RoPE did change the keys: we are after it


def test_observer_amax_equals_direct_masked_computation(gpt):
    from megatron_shims import forward

    from nemo_jetrl.megatron.attention import attach_megatron_kv, calibrate_megatron

    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 512, (2 * BATCH, SEQ), generator=gen)
    lengths = torch.tensor([16, 9, 12, 5, 16, 11])
    am = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    tmask = token_mask(am, None, "prompt_and_response")
    seen: dict[int, list] = {}
    handle = attach_megatron_kv(gpt)
    hs = _capture(gpt, seen)  # after ours: sees the same (unquantized) tensors
    settings = CalibrationSettings(reduction="max", margin=1.05, include_q=True)
    mbs = [(lambda s=s: forward(gpt, ids[s]), tmask[s]) for s in (slice(0, 3), slice(3, 6))]
    try:
        res = calibrate_megatron(gpt, mbs, settings=settings)
    finally:
        for h in hs:
            h.remove()
        handle.restore()
    assert res.micro_batches == 2 and res.sequences == 6 and not res.refused
    for layer in (0, 1):
        for t_idx, t in enumerate("qkv"):
            direct = 0.0
            for mb, (lo, hi) in enumerate(((0, 3), (3, 6))):
                x = seen[layer][mb][t_idx].double()  # [s, b, h, d]
                for b in range(hi - lo):
                    n = int(lengths[lo + b])
                    direct = max(direct, float(x[:n, b].abs().max()))
            assert res.amax[layer][t] == pytest.approx(direct, rel=0, abs=0)
            want = float(torch.tensor(direct * 1.05 / 448.0, dtype=torch.float64).float())
            assert res.scales.get(layer, t) == want
    # Real lengths instead of a mask (the mask is then built at the width Megatron runs).
    by_len = calibrate_megatron(
        gpt,
        [(lambda s=s: forward(gpt, ids[s]), lengths[s]) for s in (slice(0, 3), slice(3, 6))],
        settings=settings,
    )
    assert by_len.amax == res.amax and by_len.sequences == 6


def test_masking_padding_outliers_changes_result(gpt):
    from megatron_shims import forward

    from nemo_jetrl.megatron.attention import calibrate_megatron

    pad = 7
    ids = torch.randint(10, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    ids[:, 10:] = pad
    am = (ids != pad).long()
    emb = gpt.embedding.word_embeddings.weight
    saved = emb[pad].clone()
    # Padding carries an outlier: its embedding points along the row of linear_qkv that produces
    # V[group 0, dim 0] (rows per group: 2 query heads x 64, then K 64, then V 64), so that value
    # is sum |W| * norm weight there (RMSNorm cannot scale it away: the direction matters).
    w_v = gpt.decoder.layers[0].self_attention.linear_qkv.weight[192]
    with torch.no_grad():
        emb[pad] = torch.sign(w_v)
    try:
        run = [(lambda: forward(gpt, ids), None)]
        s_none = CalibrationSettings(reduction="max", mask="none")
        full = calibrate_megatron(gpt, run, settings=s_none)
        masked = calibrate_megatron(
            gpt,
            [(lambda: forward(gpt, ids), token_mask(am, None, "prompt_and_response"))],
            settings=CalibrationSettings(reduction="max"),
        )
    finally:
        with torch.no_grad():
            emb[pad] = saved
    assert full.amax[0]["v"] > masked.amax[0]["v"]
    assert full.scales.get(0, "v") > masked.scales.get(0, "v")


def test_onpolicy_kv_applies_rollout_quantization_and_reverts(gpt):
    from megatron_shims import forward

    from nemo_jetrl.megatron.attention import attach_megatron_kv

    ids = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = forward(gpt, ids)
    scales = KVScales({0: {"k": 0.004, "v": 0.002}, 1: {"k": 0.003, "v": 0.0025}})
    raw: dict[int, list] = {}
    handle_seen: dict[int, list] = {}
    hs = _capture(gpt, raw)  # before ours: unquantized inputs
    handle = attach_megatron_kv(gpt, scales=scales, onpolicy=True)
    assert attach_megatron_kv(gpt, scales=scales, onpolicy=True) is handle  # idempotent
    hs += _capture(gpt, handle_seen)  # after ours: what attention really gets
    try:
        with torch.no_grad():
            out = forward(gpt, ids)
    finally:
        for h in hs:
            h.remove()
    for layer in (0, 1):
        q0, k0, v0 = raw[layer][0]
        q1, k1, v1 = handle_seen[layer][0]
        assert torch.equal(q1, q0)  # queries untouched unless asked
        assert torch.equal(k1, fake_quantize_kv(k0, scales.get(layer, "k")))
        assert torch.equal(v1, fake_quantize_kv(v0, scales.get(layer, "v")))
        assert not torch.equal(k1, k0)
    assert not torch.equal(out, ref)
    # Training: the straight-through gradient reaches the QKV projection.
    gpt.zero_grad(set_to_none=True)
    forward(gpt, ids).float().logsumexp(-1).mean().backward()
    g = gpt.decoder.layers[0].self_attention.linear_qkv.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    gpt.zero_grad(set_to_none=True)
    handle.restore()
    handle.restore()
    assert not handle.active
    with torch.no_grad():
        assert torch.equal(forward(gpt, ids), ref)  # bit-identical to never having hooked
    assert all(
        not m._forward_pre_hooks for n, m in gpt.named_modules() if n.endswith("core_attention")
    )


def test_invalid_scales_refused_previous_kept(gpt):
    from megatron_shims import forward

    from nemo_jetrl.kvcache import KVScaleRefusedWarning
    from nemo_jetrl.megatron.attention import calibrate_megatron

    ids = torch.randint(0, 512, (1, SEQ), generator=torch.Generator().manual_seed(5))
    previous = KVScales({0: {"q": 0.5, "k": 0.25, "v": 0.125}})
    nothing = torch.zeros(1, SEQ, dtype=torch.bool)  # every token masked out -> amax 0
    with pytest.warns(KVScaleRefusedWarning, match="layer 0"):
        res = calibrate_megatron(
            gpt,
            [(lambda: forward(gpt, ids), nothing)],
            settings=CalibrationSettings(reduction="max"),
            previous=previous,
        )
    assert set(res.refused) == {0, 1}
    assert dict(res.scales.layers[0]) == {"q": 0.5, "k": 0.25, "v": 0.125}
    assert 1 not in res.scales.layers
