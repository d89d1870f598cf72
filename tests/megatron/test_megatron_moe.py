"""MoE under the blockwise recipe (issue 28): Megatron-Core fields, and the expert/router export
checked on a real megatron-core MoE GPTModel on CPU (4 experts, top-2, SequentialMLP).

megatron-core 0.16 builds the MoE GPT on CPU with the local spec and the ``allgather`` token
dispatcher (``alltoall`` allocates a ``torch.cuda.Stream`` at build time). Its router forward
references ``te_general_gemm``, which ``moe_utils`` binds only when TE imports (NameError here):
the test binds it to None while it runs (TEST SHIM, reverted), which is what TE-less code expects,
so the router runs its own ``torch.mm`` in ``moe_router_dtype``. TE's grouped GEMM
(``TEGroupedMLP``) cannot be built without TE: its names are exercised on renamed tensors.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from nemo_jetrl.fp8 import quantize_blockwise
from nemo_jetrl.megatron import export as ex
from nemo_jetrl.megatron import moe
from nemo_jetrl.megatron.config import MegatronRecipeError
from nemo_jetrl.recipe import Recipe

JETRL = Recipe.preset("jetrl")
BF16 = Recipe.preset("bf16")
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128)


def test_fields_dropless_fp32_router_grouped_gemm_expert_parallel():
    f = moe.moe_transformer_fields(JETRL, **MOE, expert_model_parallel_size=2)
    assert f["moe_router_dtype"] == "fp32" and f["moe_grouped_gemm"] is True
    assert (
        f["moe_expert_capacity_factor"] is None and f["moe_pad_expert_input_to_capacity"] is False
    )
    assert f["expert_model_parallel_size"] == 2
    bad = {
        "moe_expert_capacity_factor": 1.0,
        "moe_pad_expert_input_to_capacity": True,
        "moe_router_dtype": None,
        "moe_router_topk": 5,
        "moe_ffn_hidden_size": 192,
        "expert_model_parallel_size": 3,
    }
    for key, value in bad.items():
        with pytest.raises(MegatronRecipeError, match=key):
            moe.moe_transformer_fields(JETRL, **{**MOE, key: value})
    assert moe.moe_transformer_fields(BF16, **{**MOE, "moe_ffn_hidden_size": 192})  # BF16 experts


@pytest.mark.megatron
def test_a_real_transformer_config_carries_the_recipe_and_the_moe_fields(monkeypatch):
    """megatron-core refuses MoE + FP8 without TE (it asks TE's version: None here); with a
    stand-in for the version a GPU image has (TE 2.8, TEST SHIM) the rest of its checks run."""
    from megatron.core.transformer import transformer_config as tc
    from megatron_shims import TinyGpt, gpt_config_fields

    fields = gpt_config_fields(TinyGpt(kv_channels=128))  # head dim 128: see test_megatron_blocks
    moe_fields = {**MOE, "expert_model_parallel_size": 2}
    with pytest.raises(TypeError, match="'>=' not supported between instances of 'NoneType'"):
        moe.build_moe_transformer_config(JETRL, moe_fields, **fields)
    from packaging.version import Version

    monkeypatch.setattr(tc, "get_te_version", lambda: Version("2.8.0"), raising=False)
    monkeypatch.setattr(tc, "is_te_min_version", lambda v, check_equality=True: True)
    cfg = moe.build_moe_transformer_config(JETRL, moe_fields, **fields)
    assert (cfg.fp8, cfg.fp8_recipe) == ("e4m3", "blockwise")  # one recipe, experts included
    assert cfg.moe_grouped_gemm and cfg.moe_router_dtype == "fp32"
    assert cfg.moe_expert_capacity_factor is None and not cfg.moe_pad_expert_input_to_capacity
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.expert_model_parallel_size) == (4, 2, 2)


@pytest.fixture(scope="module")
def moe_gpt():
    from megatron_shims import TinyGpt, gpt_config_fields, megatron_cpu

    with megatron_cpu():
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.moe import moe_utils

        dims = TinyGpt()
        fields = moe.moe_transformer_fields(BF16, **MOE, moe_grouped_gemm=False)  # no TE here
        cfg = TransformerConfig(
            **gpt_config_fields(dims),
            **fields,
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none",
            attention_dropout=0.0,
            hidden_dropout=0.0,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
        )
        spec = get_gpt_layer_local_spec(
            num_experts=4, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
        )
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=spec,
            vocab_size=dims.vocab_size,
            max_sequence_length=dims.max_seq,
            position_embedding_type="rope",
            share_embeddings_and_output_weights=False,
        ).eval()
        mp = pytest.MonkeyPatch()
        if not hasattr(moe_utils, "te_general_gemm"):  # TEST SHIM (module docstring)
            mp.setattr(moe_utils, "te_general_gemm", None, raising=False)
        try:
            yield model, ex.GptShape.from_megatron_config(cfg)
        finally:
            mp.undo()


@pytest.mark.megatron
def test_real_moe_gpt_exports_per_expert_hf_names_that_compute_its_moe_layer(moe_gpt):
    model, shape = moe_gpt
    sd = model.state_dict()
    hf = moe.moe_megatron_to_hf(sd, shape, moe.MoeShape(ffn_hidden_size=128))
    layer = "model.layers.1.mlp"
    want = {f"{layer}.gate.weight"} | {
        f"{layer}.experts.{e}.{p}.weight" for e in range(4) for p in moe._PROJS
    }
    assert want <= set(hf) and not any("router" in n or "local_experts" in n for n in hf)
    fc1 = sd["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"]
    assert torch.equal(hf[f"{layer}.experts.2.gate_proj.weight"], fc1[:128])
    assert torch.equal(hf[f"{layer}.experts.2.up_proj.weight"], fc1[128:])
    # The exported tensors compute Megatron's own MoE layer: route (softmax over the top-2
    # logits, fp32), SiLU(gate) * up, down, weighted sum.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1, 256, generator=g)
    with torch.no_grad():
        y = model.decoder.layers[1].mlp(x)
        y = y[0] if isinstance(y, tuple) else y
        logits = x.reshape(6, 256) @ hf[f"{layer}.gate.weight"].t()
        top, idx = logits.topk(2, dim=-1)
        p = top.softmax(-1)
        ref = torch.zeros(6, 256)
        for t in range(6):
            for k in range(2):
                e = f"{layer}.experts.{int(idx[t, k])}"
                h = x[t, 0]
                a = torch.nn.functional.silu(hf[f"{e}.gate_proj.weight"] @ h)
                ref[t] += p[t, k] * (
                    hf[f"{e}.down_proj.weight"] @ (a * (hf[f"{e}.up_proj.weight"] @ h))
                )
    err = (y.reshape(6, 256) - ref).abs().max().item()
    print(f"\nMegatron MoE layer vs exported HF experts: max abs diff {err:.2e}")
    assert err < 1e-5


@pytest.mark.megatron
def test_grouped_gemm_names_expert_parallel_offset_and_per_expert_fp8(moe_gpt):
    from nemo_jetrl.vllm_patch.refit import is_fp8_weight
    from nemo_jetrl.vllm_patch.settings import settings_from_recipe

    model, shape = moe_gpt
    sd = model.state_dict()
    grouped = {}  # TEGroupedMLP's names for the same tensors: linear_fc1.weight{e}
    for k, v in sd.items():
        if ".local_experts." in k and not k.endswith("_extra_state"):
            pre, rest = k.split(".local_experts.")
            e, fc = rest.split(".", 1)
            grouped[f"{pre}.{fc}{e}"] = v
        else:
            grouped[k] = v
    ours = moe.moe_megatron_to_hf(sd, shape, moe.MoeShape(ffn_hidden_size=128))
    te = moe.moe_megatron_to_hf(grouped, shape, moe.MoeShape(ffn_hidden_size=128))
    assert ours.keys() == te.keys() and all(torch.equal(ours[k], te[k]) for k in ours)
    rank1 = moe.moe_megatron_to_hf(sd, shape, moe.MoeShape(ffn_hidden_size=128, expert_offset=4))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in rank1
    with pytest.raises(ex.ExportError, match=r"mlp\.experts\.weight1: no HuggingFace name"):
        moe.moe_megatron_to_hf(
            {"decoder.layers.0.mlp.experts.weight1": torch.zeros(1)}, shape, moe.MoeShape(128)
        )
    tensors, quantized = moe.export_moe_hf(sd, shape, moe.MoeShape(ffn_hidden_size=128), JETRL)
    experts = [n for n in quantized if ".experts." in n]
    assert len(experts) == 2 * 4 * 3 and "model.layers.0.mlp.gate.weight" not in quantized
    settings = settings_from_recipe(JETRL)
    for n in ours:  # the refit hook's rule agrees with the export's, name by name
        assert is_fp8_weight(n, settings) == (n in quantized), n
    for n in experts:
        assert re.fullmatch(r"model\.layers\.\d\.mlp\.experts\.\d\.(gate|up|down)_proj\.weight", n)
        q = quantize_blockwise(ours[n], (128, 128), pow2_scales=True)
        assert torch.equal(tensors[n].view(torch.uint8), q.data.view(torch.uint8)), n
        assert torch.equal(tensors[f"{n}_scale_inv"], q.scale_inv), n
    kws = dataclasses.replace(JETRL, rollout=JETRL.rollout.with_(bf16_layer_kws=("experts",)))
    _, q2 = moe.export_moe_hf(sd, shape, moe.MoeShape(ffn_hidden_size=128), kws)
    assert not any(".experts." in n for n in q2) and q2  # attention stays FP8
