"""keep_bf16_by_name on a real megatron-core GPTModel (CPU): exactly the Megatron linears whose
fused HF linears are all on the list run inside the FP8-off context (a recording stand-in here;
TE's own autocast in the GPU image), per pipeline-stage offset; restore puts the forwards back;
a list splitting a fused GEMM is refused."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from nemo_jetrl.megatron.bf16_names import hf_linear_names, keep_bf16_by_name

pytest.importorskip("megatron.core")


def test_megatron_names_map_to_the_hf_linears_they_fuse():
    assert hf_linear_names("module.decoder.layers.1.self_attention.linear_qkv", 4) == [
        "model.layers.5.self_attn.q_proj",
        "model.layers.5.self_attn.k_proj",
        "model.layers.5.self_attn.v_proj",
    ]
    assert hf_linear_names("decoder.layers.0.mlp.linear_fc2") == ["model.layers.0.mlp.down_proj"]
    assert hf_linear_names("decoder.layers.0.self_attention.core_attention") == []


def _run_recording(model, kws, offset=0):
    """Forward once; return (handle, names of the modules whose weight was used by a torch op
    while the FP8-off context was entered, output)."""
    from torch.overrides import TorchFunctionMode

    depth = {"n": 0}
    owner = {
        id(p): name.rsplit(".", 1)[0]
        for name, p in model.named_parameters()
        if hf_linear_names(name.rsplit(".", 1)[0])
    }
    inside: set[str] = set()

    @contextmanager
    def fp8_off():
        depth["n"] += 1
        try:
            yield
        finally:
            depth["n"] -= 1

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if depth["n"]:
                for a in (*args, *(kwargs or {}).values()):
                    if isinstance(a, torch.Tensor) and id(a) in owner:
                        inside.add(owner[id(a)])
            return func(*args, **(kwargs or {}))

    handle = keep_bf16_by_name(model, kws, layer_offset=offset, fp8_disabled=fp8_off)
    from megatron_shims import forward

    with torch.no_grad(), Spy():
        out = forward(model, torch.randint(0, 100, (2, 8)))
    return handle, sorted(inside), out


def test_listed_linears_run_inside_the_fp8_off_context_and_only_they(gpt):
    from megatron_shims import forward

    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = forward(gpt, ids)
    handle, inside, _ = _run_recording(gpt, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert inside == sorted(handle.names)
    assert all(n.endswith(("linear_qkv", "linear_proj")) for n in inside) and len(inside) == 4
    handle.restore()
    handle.restore()  # idempotent
    assert not any("forward" in m.__dict__ for _, m in gpt.named_modules())
    with torch.no_grad():
        assert torch.equal(forward(gpt, ids), before)


def test_layer_words_follow_the_pipeline_offset(gpt):
    handle, inside, _ = _run_recording(gpt, ["model.layers.3."], offset=2)  # local layer 1
    assert inside == sorted(handle.names) and all(".layers.1." in n for n in inside)
    assert len(inside) == 4  # qkv, proj, fc1, fc2 of that layer
    handle.restore()


def test_a_list_splitting_a_fused_gemm_is_refused(gpt):
    with pytest.raises(ValueError, match="one GEMM"):
        keep_bf16_by_name(gpt, ["q_proj"], fp8_disabled=contextmanager(lambda: (yield)))
    assert not any("forward" in m.__dict__ for _, m in gpt.named_modules())


def _mla_gpt(q_lora_rank):
    """A real megatron-core 0.16 MLA GPTModel (DeepSeek-V3 / Moonlight attention) on CPU. Two
    stand-ins: the local spec's DotProductAttention takes no MLA ``k_channels`` (a plain causal
    SDPA here), and without TE ``multi_latent_attention.TELinear`` is a mock, not a type."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    class CausalSdpa(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

        def forward(self, q, k, v, *args, **kwargs):
            s, b = q.shape[:2]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    cfg = MLATransformerConfig(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=2,
        ffn_hidden_size=256,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=64,
        qk_head_dim=32,
        qk_pos_emb_head_dim=16,  # kv_a_proj_with_mqa: 64 + 16 rows, as Moonlight's 512 + 64
        v_head_dim=32,
        rope_type="rope",
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec(
        multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm"
    )
    spec.submodules.self_attention.submodules.core_attention = CausalSdpa
    saved = mla.TELinear
    mla.TELinear = type("NoTransformerEngine", (), {})
    try:
        return GPTModel(
            config=cfg,
            transformer_layer_spec=spec,
            vocab_size=100,
            max_sequence_length=16,
            position_embedding_type="rope",
            share_embeddings_and_output_weights=False,
        ).eval()
    finally:
        mla.TELinear = saved


@pytest.mark.parametrize("q_lora_rank", [None, 48])
def test_latent_attention_projections_run_inside_the_fp8_off_context(gpt, q_lora_rank):
    """Moonlight's (no q LoRA) and DeepSeek-V3's per-name words: NeMo-RL's ['a_proj', 'b_proj']
    keep q_a/q_b/kv_a/kv_b BF16; ['kv_a_proj_with_mqa'] exactly the 576-row kind. (``gpt``:
    its fixture holds the module's megatron_cpu state, which cannot be entered twice.)"""
    model = _mla_gpt(q_lora_rank)
    handle, inside, _ = _run_recording(model, ["a_proj", "b_proj"])
    down_up = ["linear_kv_down_proj", "linear_kv_up_proj"]
    if q_lora_rank:
        down_up += ["linear_q_down_proj", "linear_q_up_proj"]
    want = sorted(f"decoder.layers.{i}.self_attention.{m}" for i in (0, 1) for m in down_up)
    assert inside == sorted(handle.names) == want
    handle.restore()
    handle, inside, _ = _run_recording(model, ["kv_a_proj_with_mqa"])
    assert inside == [f"decoder.layers.{i}.self_attention.linear_kv_down_proj" for i in (0, 1)]
    handle.restore()
    assert hf_linear_names("module.decoder.layers.2.self_attention.linear_kv_down_proj", 3) == [
        "model.layers.5.self_attn.kv_a_proj_with_mqa"
    ]
    assert hf_linear_names("decoder.layers.0.mlp.experts.linear_fc1") == []


def test_fp8_is_turned_off_with_tes_current_autocast_where_it_has_one(monkeypatch):
    """TE 2.15 (NeMo-RL's pin) has ``autocast`` and warns on every ``fp8_autocast`` call (read in
    its quantization.py, 2026-12-01); older 2.x has only ``fp8_autocast``. TE's CUDA modules
    cannot import here: stand-in modules carry the two names (labelled fakes)."""
    import sys
    import types

    from nemo_jetrl.megatron.bf16_names import te_fp8_disabled

    calls = []

    def fake(name):  # type: ignore[no-untyped-def]
        @contextmanager
        def ctx(enabled=True):  # type: ignore[no-untyped-def]
            calls.append((name, enabled))
            yield

        return ctx

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.autocast, te.pytorch.fp8_autocast = fake("autocast"), fake("fp8_autocast")
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    with te_fp8_disabled():
        pass
    del te.pytorch.autocast  # an older TE 2.x
    with te_fp8_disabled():
        pass
    assert calls == [("autocast", False), ("fp8_autocast", False)]
