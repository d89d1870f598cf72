"""keep_bf16_by_name on megatron-core 0.16.1's real GatedDeltaNet (Qwen3.5 / Qwen3-Next linear
attention, CPU): its in_proj computes q, k, v, z, b, a as one GEMM, so NeMo-RL's per-name words
``linear_attn.in_proj_a`` / ``in_proj_b`` cannot apply and are refused naming the word to use;
``linear_attn.in_proj`` runs the whole in_proj inside the FP8-off context; a word that matches
no module is refused instead of silently doing nothing."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from nemo_jetrl.megatron.bf16_names import hf_linear_names, keep_bf16_by_name

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def gdn_model():
    """decoder.layers.0.self_attention = a real GatedDeltaNet (local-spec linears). Its forward
    needs the FLA kernels (not installed on CPU); the module is built with HAVE_FLA forced, and
    the tests call its in_proj/out_proj, which are plain megatron linears."""
    from megatron.core.transformer import TransformerConfig
    from megatron_shims import build_gated_delta_net, megatron_cpu

    with megatron_cpu():
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=128,
            num_attention_heads=2,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
        attn = build_gated_delta_net(cfg)
        layer = torch.nn.Module()
        layer.self_attention = attn
        model = torch.nn.Module()
        model.decoder = torch.nn.Module()
        model.decoder.layers = torch.nn.ModuleList([layer])
        yield model


def _off_recorder():
    entered = {"n": 0}

    @contextmanager
    def fp8_off():
        entered["n"] += 1
        yield

    return entered, fp8_off


def test_in_proj_is_one_gemm_of_every_hf_part(gdn_model):
    in_proj = gdn_model.decoder.layers[0].self_attention.in_proj
    # q, k (2 * 64) + v, z (2 * 128) + b, a (2 * 4 heads): one weight, one GEMM.
    assert in_proj.weight.shape[0] == 2 * 64 + 2 * 128 + 2 * 4
    assert hf_linear_names("decoder.layers.0.self_attention.in_proj", 3) == [
        "model.layers.3.linear_attn.in_proj"
    ]


@pytest.mark.parametrize(
    "kws", [["linear_attn.in_proj_a", "linear_attn.in_proj_b"], ["in_proj_qkvz"], ["in_proj_z"]]
)
def test_a_word_naming_part_of_in_proj_is_refused(gdn_model, kws):
    with pytest.raises(ValueError, match=r"one GEMM.*'linear_attn\.in_proj'") as exc:
        keep_bf16_by_name(gdn_model, kws, fp8_disabled=_off_recorder()[1])
    assert "jetrl.train_bf16_layer_kws" in str(exc.value) and kws[0] in str(exc.value)
    assert not any("forward" in m.__dict__ for _, m in gdn_model.named_modules())


def test_the_whole_in_proj_runs_with_fp8_off(gdn_model):
    entered, fp8_off = _off_recorder()
    kws = ["linear_attn.conv1d", "linear_attn.in_proj", "visual"]  # what align writes
    handle = keep_bf16_by_name(gdn_model, kws, fp8_disabled=fp8_off)
    assert handle.names == ["decoder.layers.0.self_attention.in_proj"]
    attn = gdn_model.decoder.layers[0].self_attention
    x = torch.randn(3, 1, 128)
    with torch.no_grad():
        attn.out_proj(torch.randn(3, 1, 128))
        assert entered["n"] == 0
        attn.in_proj(x)
    assert entered["n"] == 1
    handle.restore()
    handle = keep_bf16_by_name(gdn_model, ["linear_attn.out_proj"], fp8_disabled=fp8_off)
    assert handle.names == ["decoder.layers.0.self_attention.out_proj"]
    handle.restore()


@pytest.mark.parametrize("word", ["in_proj_c", "layers.0.self_attn.q_proj", "gate_proj"])
def test_a_word_matching_no_module_is_refused(gdn_model, word):
    with pytest.raises(ValueError, match="match no Megatron linear") as exc:
        keep_bf16_by_name(gdn_model, ["linear_attn.in_proj", word], fp8_disabled=_off_recorder()[1])
    assert repr(word) in str(exc.value) and "jetrl.train_bf16_layer_kws" in str(exc.value)
    assert not any("forward" in m.__dict__ for _, m in gdn_model.named_modules())
    # a word naming a layer another pipeline stage holds is that stage's to apply
    keep_bf16_by_name(gdn_model, ["layers.7.mlp"], fp8_disabled=_off_recorder()[1]).restore()
    # words for what training keeps BF16 anyway (align writes the MoE router's mlp.gate)
    anyway = ["visual", "linear_attn.conv1d", "lm_head", "mlp.gate", "mlp.shared_expert_gate"]
    assert keep_bf16_by_name(gdn_model, anyway, fp8_disabled=_off_recorder()[1]).names == []


def test_a_pipeline_stage_of_linear_attention_only_gets_an_empty_kv_handle(gdn_model):
    """A hybrid model's pipeline stage may hold no full attention (Qwen3.5 / Qwen3-Next: every
    4th layer; NeMo-RL's DeepSeek-style first stage of 3 layers). The policy worker's KV hooks
    raised there at init, on every rank of the stage; now the stage gets a live handle with no
    hooks, and calibration takes its layers' amax from the stages that have them."""
    from nemo_jetrl.kvcache import CalibrationSettings
    from nemo_jetrl.megatron.attention import attach_megatron_kv, calibrate_megatron

    with pytest.raises(ValueError, match=r"no '.*core_attention' module"):
        attach_megatron_kv(gdn_model)  # outside a pipeline: the model is not what we think
    handle = attach_megatron_kv(gdn_model, onpolicy=True, allow_empty=True)
    try:
        assert handle.active and handle.layers == []
        assert attach_megatron_kv(gdn_model, onpolicy=True) is handle  # idempotent
        other_stage = {3: {"k": 7.0, "v": 2.5}}
        calls = []
        res = calibrate_megatron(
            gdn_model,
            [(lambda: calls.append(1), None)],
            settings=CalibrationSettings(include_q=False),
            reduce_amax=lambda amax: {**amax, **other_stage},  # the merge over every rank
        )
        assert calls == [1] and handle.active  # the stage ran its forward; the handle stays
        assert res.amax == other_stage and set(res.scales.layers) == {3}
    finally:
        handle.restore()
    assert not handle.active


def test_a_bf16_word_is_judged_over_every_pipeline_stage(gdn_model):
    """A word naming what only another stage holds (Moonlight's dense layer 0 under PP=4: its
    `mlp.down_proj` is on stage 0 only) was refused by every other stage at worker init. With
    ``gather`` (the worker's all-gather over every rank) a word is refused only when no stage
    matched it, and a problem found on one rank raises on every rank (none waits in the gather)."""
    kws = ["linear_attn.out_proj", "mlp.down_proj"]
    with pytest.raises(ValueError, match=r"\['mlp.down_proj'\] match no Megatron linear"):
        keep_bf16_by_name(gdn_model, kws, fp8_disabled=_off_recorder()[1])  # this stage alone
    stage0 = (["mlp.down_proj"], [0], None)  # what the stage holding layer 0 found
    seen = []

    def gather(mine):
        seen.append(mine)
        return [stage0, mine]

    entered, fp8_off = _off_recorder()
    handle = keep_bf16_by_name(gdn_model, kws, fp8_disabled=fp8_off, gather=gather)
    assert entered["n"] == 0  # wrapped, not yet called
    try:
        assert handle.names == ["decoder.layers.0.self_attention.out_proj"]
        assert seen == [(["linear_attn.out_proj"], [0], None)]  # called once with its findings
    finally:
        handle.restore()
    nobody = (["linear_attn.out_proj"], [1], None)
    with pytest.raises(ValueError, match=r"\['mlp.down_proj'\] match no Megatron linear"):
        keep_bf16_by_name(gdn_model, kws, fp8_disabled=fp8_off, gather=lambda m: [nobody, m])
    other = ([], [1], "layers.1 computes ... as one GEMM")  # another rank's refusal
    with pytest.raises(ValueError, match=r"layers\.1 computes"):
        keep_bf16_by_name(gdn_model, ["linear_attn.out_proj"], fp8_disabled=fp8_off,
                          gather=lambda m: [m, other])  # fmt: skip
    attn = gdn_model.decoder.layers[0].self_attention
    assert "forward" not in attn.out_proj.__dict__  # unwrapped when refused
    # a refusal on this rank still reaches the gather (the others would wait there otherwise)
    seen.clear()
    with pytest.raises(ValueError, match="one GEMM"):
        keep_bf16_by_name(gdn_model, ["linear_attn.in_proj_a"], fp8_disabled=fp8_off,
                          gather=gather)  # fmt: skip
    assert len(seen) == 1 and "one GEMM" in seen[0][2]


def test_with_every_stage_asked_a_word_naming_a_missing_layer_is_refused(gdn_model):
    """Without ``gather`` a word naming a layer this stage lacks is let pass (another stage may
    hold it); with every stage's answer (the worker's gather, PP=1 included) a layer no stage
    holds is a typo, refused instead of silently running that layer in FP8."""
    _, fp8_off = _off_recorder()
    word = ["layers.99.mlp.down_proj"]
    keep_bf16_by_name(gdn_model, word, fp8_disabled=fp8_off).restore()  # this stage alone
    with pytest.raises(ValueError, match=r"\['layers.99.mlp.down_proj'\] match no Megatron"):
        keep_bf16_by_name(gdn_model, word, fp8_disabled=fp8_off, gather=lambda m: [m])
    # what training keeps BF16 anyway is never asked of a stage
    keep_bf16_by_name(gdn_model, ["lm_head"], fp8_disabled=fp8_off, gather=lambda m: [m]).restore()


def test_a_problem_found_before_the_bf16_words_reaches_every_rank(gdn_model):
    """A rank whose KV hooks failed enters the same gather the other ranks' keep_bf16_by_name
    waits in (`refuse_with_ranks`), so every rank raises it instead of waiting for it."""
    from nemo_jetrl.megatron.bf16_names import refuse_with_ranks

    sent = []
    with pytest.raises(ValueError, match=r"^ValueError: two core attentions$"):
        refuse_with_ranks("ValueError: two core attentions", lambda m: sent.append(m) or [m])
    (mine,) = sent
    _, fp8_off = _off_recorder()
    with pytest.raises(ValueError, match="two core attentions"):  # the other rank
        keep_bf16_by_name(gdn_model, [], fp8_disabled=fp8_off, gather=lambda m: [mine, m])
