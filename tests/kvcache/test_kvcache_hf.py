"""FP8 KV on real HuggingFace models built from configs: observers, masks, scales, handles."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import tiny_hf_config, tiny_hf_model  # noqa: E402

from nemo_jetrl.kvcache import (  # noqa: E402
    CalibrationSettings,
    KVScaleRefusedWarning,
    KVScales,
    fake_quantize_kv,
    masked_amax,
    scales_from_amax,
)
from nemo_jetrl.kvcache.hf import KVCacheController, attach_kv, calibrate  # noqa: E402

PAD = 0


def _config(kind: str, attn: str = "eager"):
    # qwen3: q/k RMSNorm before RoPE, explicit head_dim
    extra = {"head_dim": 16} if kind == "qwen3" else {}
    cfg = tiny_hf_config(kind, num_hidden_layers=3, pad_token_id=PAD, **extra)
    cfg._attn_implementation = attn
    return cfg


def _model(kind: str = "llama", attn: str = "eager", seed: int = 0):
    return tiny_hf_model(_config(kind, attn), seed=seed)


def _batch(seed: int = 0, lengths=(12, 9, 7, 12, 5), prompt_len: int = 4, total: int = 12):
    """Right-padded batch: input_ids, attention_mask, response_mask (tokens after the prompt)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), total), PAD)
    am = torch.zeros(len(lengths), total, dtype=torch.long)
    rm = torch.zeros(len(lengths), total, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(1, 96, (n,), generator=g)
        am[b, :n] = 1
        rm[b, prompt_len:n] = 1
    return ids, am, rm


def _direct_qkv(model, ids, am):
    """q, k, v of every layer computed by hand from the attention inputs (no wrapper involved)."""
    captured = {}

    def pre_hook(module, args, kwargs):
        captured[module.layer_idx] = (
            kwargs.get("hidden_states", args[0] if args else None),
            kwargs["position_embeddings"],
        )

    hooks = [
        m.self_attn.register_forward_pre_hook(pre_hook, with_kwargs=True)
        for m in model.model.layers
    ]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=am, use_cache=False)
    for h in hooks:
        h.remove()
    out = {}
    for layer in model.model.layers:
        attn = layer.self_attn
        hs, (cos, sin) = captured[attn.layer_idx]
        shape = (*hs.shape[:-1], -1, attn.head_dim)
        with torch.no_grad():
            q = attn.q_proj(hs).view(shape)
            k = attn.k_proj(hs).view(shape)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = attn.v_proj(hs).view(shape).transpose(1, 2)
            rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
            q, k = rope(q, k, cos, sin)
        out[attn.layer_idx] = {"q": q, "k": k, "v": v}
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_observer_amax_equals_direct_computation(kind: str) -> None:
    model = _model(kind)
    ids, am, rm = _batch()
    direct = _direct_qkv(model, ids, am)
    settings = CalibrationSettings(reduction="max", micro_batch_size=len(ids), margin=1.0)
    for mode, mask in (
        ("prompt_and_response", am.bool()),
        ("response", (rm & am).bool()),
        ("none", None),
    ):
        res = calibrate(model, ids, am, rm, settings=settings, mask=mode)
        assert res.micro_batches == 1 and not res.refused
        for i, per in direct.items():
            for t in "qkv":
                want = float(masked_amax(per[t], mask))
                assert res.amax[i][t] == want, (kind, mode, i, t)
                assert res.scales.get(i, t) == float(torch.tensor(want / 448.0))
    assert model.config._attn_implementation == "eager"  # calibrate restored the model


def test_masked_padding_with_outliers_changes_the_result() -> None:
    model = _model("llama")
    # Padding carries huge activations that no real token has: its embedding is the one-hot
    # direction j, which real tokens never use, and layer 0's q/k/v projections amplify j.
    j = 5
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, j] = 0.0
        emb[PAD] = 0.0
        emb[PAD, j] = 1.0
        attn = model.model.layers[0].self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight[:, j] *= 1000.0
    ids, am, rm = _batch(lengths=(12, 6, 8, 5))
    s = CalibrationSettings(reduction="max", micro_batch_size=2)
    masked = calibrate(model, ids, am, rm, settings=s, mask="prompt_and_response")
    unmasked = calibrate(model, ids, am, rm, settings=s, mask="none")
    for t in "qkv":
        assert unmasked.amax[0][t] > 10 * masked.amax[0][t], t
    for i in masked.amax:  # "none" counts a superset of the tokens
        for t in "qkv":
            assert unmasked.amax[i][t] >= masked.amax[i][t], (i, t)
    # Masked result equals calibrating each sequence alone, without any padding.
    alone = {}
    for b in range(len(ids)):
        n = int(am[b].sum())
        r = calibrate(model, ids[b : b + 1, :n], am[b : b + 1, :n], settings=s)
        for i, per in r.amax.items():
            for t, a in per.items():
                alone[(i, t)] = max(alone.get((i, t), 0.0), a)
    for (i, t), a in alone.items():
        assert masked.amax[i][t] == pytest.approx(a, rel=1e-5), (i, t)


def test_percentile_over_micro_batches_and_data_fraction() -> None:
    model = _model("qwen2")
    ids, am, rm = _batch(lengths=(12, 11, 10, 9, 8, 7, 6, 5))
    per_seq = calibrate(model, ids, am, rm, settings=CalibrationSettings(micro_batch_size=1))
    assert per_seq.micro_batches == 8 and per_seq.sequences == 8
    full = calibrate(
        model,
        ids,
        am,
        rm,
        settings=CalibrationSettings(
            reduction="percentile", percentile=50, micro_batch_size=1, margin=1.0
        ),
    )
    mx = calibrate(model, ids, am, rm, settings=CalibrationSettings(reduction="max", margin=1.0))
    assert any(full.amax[i]["k"] < mx.amax[i]["k"] for i in mx.amax)  # median < max
    half = calibrate(model, ids, am, rm, settings=CalibrationSettings(data_fraction=0.5))
    assert half.sequences == 4


def test_invalid_scales_refused_and_previous_kept() -> None:
    prev = KVScales({0: {"q": 0.5, "k": 0.25, "v": 0.125}, 1: {"k": 2.0, "v": 3.0}})
    amax = {
        0: {"q": 10.0, "k": float("nan"), "v": 5.0},
        1: {"k": 0.0, "v": 4.0},
        2: {"k": float("inf"), "v": 1.0},
        3: {"k": 448.0, "v": 224.0},
    }
    s = CalibrationSettings(margin=1.0)
    with pytest.warns(KVScaleRefusedWarning) as rec:
        scales, refused = scales_from_amax(amax, s, prev)
    assert sorted(refused) == [0, 1, 2]
    msgs = [str(w.message) for w in rec]
    assert any("layer 0" in m and "k amax=nan" in m for m in msgs)
    assert any("layer 1" in m and "model.layers.1.self_attn" in m for m in msgs)
    assert dict(scales.layers[0]) == {"q": 0.5, "k": 0.25, "v": 0.125}
    assert dict(scales.layers[1]) == {"k": 2.0, "v": 3.0}
    assert 2 not in scales.layers and scales.get(2, "k") == 1.0  # vLLM's default
    assert dict(scales.layers[3]) == {"k": 1.0, "v": 0.5}


def test_all_masked_layers_refused_end_to_end() -> None:
    model = _model("llama")
    ids, am, rm = _batch()
    prev = calibrate(model, ids, am, rm).scales
    with pytest.warns(KVScaleRefusedWarning):
        res = calibrate(model, ids, am, torch.zeros_like(rm), previous=prev, mask="response")
    assert sorted(res.refused) == [0, 1, 2]
    assert res.scales.to_vllm() == prev.to_vllm()


def test_handle_restores_original_attention() -> None:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    for attn in ("eager", "sdpa"):
        model = _model("llama", attn)
        ids, am, _ = _batch()
        with torch.no_grad():
            before = model(input_ids=ids, attention_mask=am).logits
        h = attach_kv(
            model, scales=KVScales({i: {"k": 0.01, "v": 0.01} for i in range(3)}), quantize=True
        )
        assert attach_kv(model, quantize=True) is h  # idempotent
        assert model.config._attn_implementation == h.name != attn
        assert h.name in AttentionInterface._global_mapping
        with torch.no_grad():
            quantized = model(input_ids=ids, attention_mask=am).logits
        assert not torch.equal(quantized, before)
        h.restore()
        h.restore()  # idempotent
        assert model.config._attn_implementation == attn
        assert h.name not in AttentionInterface._global_mapping
        assert h.name not in AttentionMaskInterface._global_mapping
        with torch.no_grad():
            after = model(input_ids=ids, attention_mask=am).logits
        assert torch.equal(after, before)


def test_models_sharing_a_config_are_attached_independently() -> None:
    cfg = _config("llama")
    torch.manual_seed(0)
    a = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    torch.manual_seed(0)
    b = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert a.config is b.config
    ids, am, _ = _batch()
    with torch.no_grad():
        before = b(input_ids=ids, attention_mask=am).logits
    ha = attach_kv(a, scales=KVScales({i: {"k": 0.01, "v": 0.01} for i in range(3)}), quantize=True)
    hb = attach_kv(b)  # observers only: b's numbers must not change
    assert ha is not hb and ha.name != hb.name
    with torch.no_grad():
        assert torch.equal(b(input_ids=ids, attention_mask=am).logits, before)
        assert not torch.equal(a(input_ids=ids, attention_mask=am).logits, before)
    ha.restore()
    hb.restore()
    assert a.config is cfg and b.config is cfg and cfg._attn_implementation == "eager"


def test_attach_without_quantization_changes_nothing() -> None:
    model = _model("qwen3", "sdpa")
    ids, am, _ = _batch()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=am).logits
        with attach_kv(model):
            during = model(input_ids=ids, attention_mask=am).logits
    assert torch.equal(during, before)


@pytest.mark.parametrize("kernel", ["cuda", "cpu"])
def test_rollout_cache_holds_fp8_values_and_matches_full_forward(kernel: str) -> None:
    model = _model("llama")
    ids, am, _ = _batch(lengths=(6, 6, 6), prompt_len=6, total=6)
    ctl = KVCacheController(CalibrationSettings(margin=1.05), kernel=kernel)
    h = ctl.attach(model, role="rollout")
    ctl.calibrate(model, ids, am, mask="prompt_and_response")
    cache = ctl.rollout_cache()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=am,
            max_new_tokens=6,
            do_sample=False,
            past_key_values=cache,
            return_dict_in_generate=True,
            output_scores=True,
            pad_token_id=PAD,
        )
    # The cache holds exactly the values an FP8 cache returns: quantizing them again is a no-op
    # for the rounding kernel, and every element is an E4M3 value times the scale.
    for i, layer in enumerate(cache.layers):
        sk = ctl.scales.get(i, "k")
        k = layer.keys
        codes = (k.double() / sk).float().to(torch.float8_e4m3fn).double() * sk
        assert torch.allclose(k.double(), codes, rtol=2**-20, atol=0), i
        if kernel == "cuda":
            assert torch.equal(fake_quantize_kv(k, sk), k)
    # The same model on the full sequence (trainer-style forward, FP8 KV in attention) gives the
    # same next-token logits as the incremental decode with the FP8 cache.
    seq = out.sequences
    with torch.no_grad():
        full = model(input_ids=seq, attention_mask=torch.ones_like(seq)).logits
    for step, scores in enumerate(out.scores):
        torch.testing.assert_close(scores, full[:, ids.shape[1] - 1 + step], rtol=1e-4, atol=1e-4)
    h.restore()


def test_cpu_kernel_refuses_a_cache_that_did_not_quantize() -> None:
    model = _model("llama")
    ids, am, _ = _batch(lengths=(6, 6), prompt_len=6, total=6)
    with (
        attach_kv(model, quantize=True, kernel="cpu"),
        pytest.raises(RuntimeError, match="new_cache"),
    ):
        model.generate(ids, attention_mask=am, max_new_tokens=2, do_sample=False, pad_token_id=PAD)


def test_onpolicy_training_forward_equals_rollout_and_has_straight_through_grads() -> None:
    rollout, train = _model("qwen2"), _model("qwen2")
    ids, am, rm = _batch()
    ctl = KVCacheController(CalibrationSettings(micro_batch_size=2))
    ctl.attach(rollout, role="rollout")
    ht = ctl.attach(train, role="train", onpolicy=True)
    res = ctl.calibrate(train, ids, am, rm)
    assert res.seconds > 0 and ctl.handles["rollout"].state.scales is res.scales
    with torch.no_grad():
        r = rollout(input_ids=ids, attention_mask=am).logits
    t = train(input_ids=ids, attention_mask=am).logits
    assert torch.equal(t.detach(), r)  # on-policy: trainer sees the rollout's KV numbers
    t[am.bool()].logsumexp(-1).sum().backward()
    g = train.model.layers[0].self_attn.k_proj.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    # Off-policy (trainer without KV quantization) differs from the FP8-KV rollout.
    ht.set_mode(quantize=False)
    with torch.no_grad():
        off = train(input_ids=ids, attention_mask=am).logits
    assert not torch.equal(off, r)
    ctl.detach()
    assert rollout.config._attn_implementation == "eager"


def test_settings_from_recipe_and_validation() -> None:
    from nemo_jetrl.recipe import KvCalibration

    s = CalibrationSettings.from_recipe(KvCalibration(percentile=100.0, margin=1.2, mask="none"))
    assert (s.reduction, s.percentile, s.margin, s.mask) == ("max", 100.0, 1.2, "none")
    with pytest.raises(ValueError) as e:
        CalibrationSettings(
            data_fraction=0.0, percentile=101, margin=0.5, mask="pad", reduction="p"
        )
    for key in ("data_fraction", "percentile", "margin", "mask", "reduction"):
        assert key in str(e.value)


def test_scale_names() -> None:
    sc = KVScales({3: {"q": 0.5, "k": 0.25, "v": 0.125}})
    assert sc.to_vllm() == {
        "model.layers.3.self_attn.attn.q_scale": 0.5,
        "model.layers.3.self_attn.k_scale": 0.25,
        "model.layers.3.self_attn.v_scale": 0.125,
    }
    assert KVScales.from_vllm(sc.to_vllm()).to_vllm() == sc.to_vllm()
    assert sc.to_megatron(layer_offset=2) == {
        "decoder.layers.1.self_attention.core_attention.q_scale": 0.5,
        "decoder.layers.1.self_attention.core_attention.k_scale": 0.25,
        "decoder.layers.1.self_attention.core_attention.v_scale": 0.125,
    }
    from nemo_jetrl.kvcache import names

    assert (
        names.layer_index_from_megatron("module.decoder.layers.5.self_attention.core_attention")
        == 5
    )
    assert names.layer_index_from_hf("model.layers.7.self_attn.attn.k_scale") == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert KVScales.from_dict(sc.to_dict()).to_vllm() == sc.to_vllm()


def test_the_local_extra_asks_for_the_transformers_fp8_kv_needs() -> None:
    """`pip install nemo-jetrl[local]` must not admit a transformers that `jetrl_kv` refuses
    at run time (the extra said >=4.45 while the attention hooks need 4.48)."""
    import re

    import tomllib
    from conftest import REPO

    from nemo_jetrl.kvcache.hf_attention import MIN_TRANSFORMERS

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (req,) = [r for r in extras["local"] if r.startswith("transformers")]
    floor = tuple(int(x) for x in re.fullmatch(r"transformers>=([0-9.]+)", req)[1].split("."))
    assert floor >= MIN_TRANSFORMERS, req
