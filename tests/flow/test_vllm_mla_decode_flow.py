"""vLLM's MLA decode takes kv_b_proj's product in BF16 (the absorbed W_UK_T/W_UV dequantized from
its FP8 weight) and never quantizes its input; the flow must say so on a vLLM rollout and not on
the local HF rollout, whose FP8 kv_b_proj is a real FP8 GEMM (issue 39)."""

from __future__ import annotations

from nemo_jetrl.arch import ModelArch
from nemo_jetrl.config.layer_lists import ROLLOUT_KEY, TRAIN_KEY
from nemo_jetrl.flow.check import check_on_policy
from nemo_jetrl.flow.graph import HF_ROLLOUT_BUILDERS, build_flow
from nemo_jetrl.flow.vllm_bf16 import vllm_bf16_kinds, vllm_bf16_words
from nemo_jetrl.recipe import Recipe

# A tiny dense DeepSeek-V3 (as tests/vllm_patch/test_vllm_mla.py serves): 576-row kv_a_proj_with_mqa.
TINY_MLA = ModelArch.from_hf_config(
    dict(
        model_type="deepseek_v3", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        first_k_dense_replace=2, n_routed_experts=None, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=128, q_lora_rank=128, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    ),
    name="tiny-mla",
)  # fmt: skip
KV_B = [f"model.layers.{i}.self_attn.kv_b_proj" for i in range(2)]
KV_A = [f"model.layers.{i}.self_attn.kv_a_proj_with_mqa" for i in range(2)]


def _edges(flow, ops):
    return {(e.op, e.role): e.precision for e in flow.edges if e.op in ops}


def test_a_vllm_rollout_names_kv_b_proj_and_says_why_and_what_to_do():
    c = check_on_policy(TINY_MLA, Recipe.preset("jetrl"))
    assert not c.on_policy
    (m,) = c.mismatches
    assert set(m.edges) == {f"{op}:{role}" for op in KV_B for role in ("weight", "input")}
    assert "W_UK_T/W_UV" in m.reason and "never quantized to FP8 1x128" in m.reason
    assert f"add 'kv_b_proj' to {ROLLOUT_KEY}" in m.reason and TRAIN_KEY in m.reason
    assert m.keys == (ROLLOUT_KEY, TRAIN_KEY)
    assert m.fixes == (f"{TRAIN_KEY}=['kv_b_proj']", f"and {ROLLOUT_KEY}=['kv_b_proj']")
    assert m.details() == [
        "weight: training FP8 e4m3 128x128 pow2 [te] vs rollout BF16 dequantized from FP8 e4m3 "
        "128x128 pow2 [jetrl]",
        "input: training FP8 e4m3 1x128 pow2 [te] vs rollout BF16",
    ]
    # the 576-row kv_a_proj_with_mqa (and every other linear) stays FP8 on the rollout
    roll = _edges(c.rollout, KV_A)
    assert len(roll) == 4 and all(p.is_fp8 and p.impl == "jetrl" for p in roll.values())
    assert vllm_bf16_kinds(TINY_MLA, Recipe.preset("jetrl")) == ["kv_b_proj"]


def test_the_local_hf_rollout_and_megatron_generation_run_kv_b_proj_as_fp8():
    jetrl = Recipe.preset("jetrl")
    assert check_on_policy(TINY_MLA, jetrl, HF_ROLLOUT_BUILDERS).on_policy
    hf = _edges(build_flow(TINY_MLA, jetrl, "rollout", HF_ROLLOUT_BUILDERS), KV_B)
    assert all(p.is_fp8 and p.why is None for p in hf.values())
    # NeMo-RL's Megatron generation (the reader's rollout = the training side, quantizer te)
    megatron = jetrl.with_(rollout=jetrl.train)
    assert check_on_policy(TINY_MLA, megatron).on_policy
    # a BF16 rollout never quantizes kv_b_proj on either engine: nothing to name
    assert vllm_bf16_kinds(TINY_MLA, Recipe.preset("bf16")) == []


def test_kv_b_proj_bf16_on_both_sides_is_on_policy_and_one_side_is_not():
    jetrl = Recipe.preset("jetrl")
    both = jetrl.with_bf16_layer_kws(("kv_b_proj",))
    c = check_on_policy(TINY_MLA, both)
    assert c.on_policy, [m.reason for m in c.mismatches]
    assert all(not p.is_fp8 for p in _edges(c.rollout, KV_B).values())
    assert all(p.is_fp8 for p in _edges(c.rollout, KV_A).values())
    assert all(p.is_fp8 for p in _edges(c.train_fwd, KV_A).values())
    assert vllm_bf16_words(TINY_MLA, both) == ((), [])
    # Training BF16 alone: vLLM's W_UK_T/W_UV are the FP8 weight dequantized, not the BF16
    # master weight training multiplies by, so the weight still differs.
    train_only = jetrl.with_(train=jetrl.train.with_(bf16_layer_kws=("kv_b_proj",)))
    (m,) = check_on_policy(TINY_MLA, train_only).mismatches
    assert set(m.edges) == {f"{op}:weight" for op in KV_B} and "W_UK_T/W_UV" in m.reason


def test_the_local_verdict_follows_its_rollout_engine():
    """Local backend: HF rollout on-policy (kv_b_proj a real FP8 GEMM), vLLM rollout not."""
    from nemo_jetrl.config import load_config, settings_of
    from nemo_jetrl.flow.backend import backend_verdicts

    check = check_on_policy(TINY_MLA, Recipe.preset("jetrl"))
    local = "examples/configs/local/jetrl.yaml"
    for engine, on in (("hf", True), ("vllm", False)):
        settings = settings_of(load_config(local, [f"++jetrl.local.rollout_engine={engine}"]))
        verdict = backend_verdicts(settings, check, TINY_MLA)[0]
        assert (verdict.backend, verdict.on_policy) == ("local", on), verdict
        assert ("kv_b_proj included" in verdict.reason) is on


def test_jetrl_train_on_the_local_hf_rollout_is_not_refused_for_vllms_mla_decode():
    """The train gate (`off_policy_refusal(backend="local")`) follows the local verdict: the HF
    rollout runs kv_b_proj as an FP8 GEMM, so only a vLLM rollout is refused."""
    from types import SimpleNamespace

    from nemo_jetrl.config import load_config, settings_of
    from nemo_jetrl.flow.backend import backend_verdicts
    from nemo_jetrl.flow.pipeline import off_policy_refusal

    jetrl = Recipe.preset("jetrl")
    check = check_on_policy(TINY_MLA, jetrl)
    local = "examples/configs/local/jetrl.yaml"
    for engine, refused in (("hf", False), ("vllm", True)):
        cfg = load_config(local, [f"++jetrl.local.rollout_engine={engine}"])
        settings = settings_of(cfg)
        checked = SimpleNamespace(
            cfg=cfg,  # the refusal's fix names overrides for it (`flow.fixes`)
            check=check,
            allow_off_policy=False,
            limits_of=lambda kind: [],
            backends=backend_verdicts(settings, check, TINY_MLA),
            recipe=jetrl,
        )
        why = off_policy_refusal(checked, backend="local")
        assert (why is not None) is refused, why
        if refused:
            assert "kv_b_proj" in why


def test_an_fp8_kv_cache_of_latent_attention_has_no_trainer_side_on_vllm():
    """vLLM's MLA cache holds the compressed latent and the rotary key with one k_scale; the
    trainer's attention (Megatron's core_attention, HF's) sees per-head K/V after kv_b_proj, so
    on-policy KV and its calibration would describe other tensors (found by reading Megatron-Core
    0.16's MLA and vLLM's MLA cache, 2026-12-01). On a vLLM rollout an FP8 KV cache of an MLA
    model is off-policy whatever the trainer does, and the fix named is the cache's dtype alone;
    the local HF rollout caches per-head K/V itself, so on-policy KV holds there."""
    from nemo_jetrl.config.schema import VLLM_KV_DTYPE

    both_bf16 = {TRAIN_KEY: ("kv_b_proj",), ROLLOUT_KEY: ("kv_b_proj",)}
    kv = Recipe.preset("jetrl_kv")
    kv = kv.with_(train=kv.train.with_(bf16_layer_kws=both_bf16[TRAIN_KEY]),
                  rollout=kv.rollout.with_(bf16_layer_kws=both_bf16[ROLLOUT_KEY]))  # fmt: skip
    c = check_on_policy(TINY_MLA, kv)
    assert not c.on_policy
    (m,) = c.mismatches
    assert "vLLM's MLA cache holds the compressed latent" in m.reason
    assert m.keys == (VLLM_KV_DTYPE,) and m.fixes == (f"{VLLM_KV_DTYPE}=auto",)
    assert check_on_policy(TINY_MLA, kv, HF_ROLLOUT_BUILDERS).on_policy
    bf16_kv = Recipe.preset("jetrl")  # the same linears, the KV cache BF16: on-policy
    bf16_kv = bf16_kv.with_(train=bf16_kv.train.with_(bf16_layer_kws=both_bf16[TRAIN_KEY]),
                            rollout=bf16_kv.rollout.with_(bf16_layer_kws=both_bf16[ROLLOUT_KEY]))  # fmt: skip
    assert check_on_policy(TINY_MLA, bf16_kv).on_policy
