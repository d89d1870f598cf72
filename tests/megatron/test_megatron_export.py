"""Refit export: Megatron names -> HF names, unfusing, FP8 quantization, TE layout re-use.

Real megatron-core GPTModel on CPU (tests/megatron_shims.py) and a real HF Qwen3 model built from
a config: the exported tensors must make the HF model compute the same logits.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_jetrl.fp8 import quantize_blockwise
from nemo_jetrl.fp8.layouts import TeBlockwiseTensor, to_te
from nemo_jetrl.megatron import export as ex
from nemo_jetrl.recipe import Recipe

JETRL = Recipe.preset("jetrl")
# The seven linears of a Llama/Qwen decoder layer in HF's names (LlamaDecoderLayer's self_attn
# and mlp): every one runs FP8 in an FP8 layer, so every one must be exported FP8. A literal, so
# a linear dropped from `export.FP8_LINEARS` fails here.
LAYER_LINEARS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


@pytest.fixture(scope="module")
def megatron_env():
    from megatron_shims import megatron_cpu

    with megatron_cpu():
        yield


def _model(**dims):
    from megatron_shims import TinyGpt, build_gpt

    m = build_gpt(TinyGpt(**dims))
    m.eval()
    return m


def _hf_qwen3(model, shape: ex.GptShape):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = model.config
    hf_cfg = Qwen3Config(
        vocab_size=model.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=shape.num_query_groups,
        head_dim=shape.head_dim,
        rms_norm_eps=cfg.layernorm_epsilon,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        max_position_embeddings=64,
        torch_dtype="float32",
    )
    return Qwen3ForCausalLM(hf_cfg).eval()


@pytest.mark.megatron
def test_hf_names_reproduce_megatron_forward(megatron_env):
    from megatron_shims import forward

    model = _model()
    shape = ex.GptShape.from_megatron_config(model.config)
    hf_sd = ex.megatron_to_hf(model.state_dict(), shape)
    hf = _hf_qwen3(model, shape)
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    assert unexpected == []
    assert [k for k in missing if "rotary" not in k] == []
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = forward(model, ids).double()
        got = hf(ids).logits.double()
    # Same fp32 math in a different op order: agree to fp32 rounding (a wrong interleave or
    # gate/up swap gives O(1) differences).
    assert (got - ref).abs().max().item() < 1e-4
    # Unfused q rows of KV group 1 come from the fused rows right after group 0's q, k, v.
    w = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert torch.equal(hf_sd["model.layers.0.self_attn.q_proj.weight"][128:256], w[256:384])
    assert torch.equal(hf_sd["model.layers.0.self_attn.k_proj.weight"][64:128], w[384:448])


@pytest.mark.megatron
def test_fp8_export_matches_quantizer_on_unfused_weights(megatron_env):
    model = _model()
    shape = ex.GptShape.from_megatron_config(model.config)
    recipe = JETRL.with_(rollout=JETRL.rollout.with_(bf16_first_layers=1))
    tensors, quantized = ex.export_hf(model.state_dict(), shape, recipe)
    hf = ex.megatron_to_hf(model.state_dict(), shape)
    # Layer 0 stays BF16 on the rollout side; layer 1's seven linears are FP8.
    assert sorted(quantized) == sorted(f"model.layers.1.{s}" for s in LAYER_LINEARS)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    for name, q in quantized.items():
        ref = quantize_blockwise(hf[name], (128, 128), fmt="e4m3", pow2_scales=True)
        assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)), name
        assert torch.equal(q.scale_inv, ref.scale_inv), name
        assert tensors[name].dtype == torch.float8_e4m3fn
        assert torch.equal(tensors[ex.scale_inv_name(name)], q.scale_inv)
        n, k = hf[name].shape
        assert q.scale_inv.shape == (math.ceil(n / 128), math.ceil(k / 128))
        # Dequantized within E4M3 bounds of the master weight: half an ulp (2^-4 relative) for
        # normals, half the smallest subnormal step (2^-10 * scale_inv) below.
        w = hf[name].double()
        deq = q.dequantize(torch.float64)
        s = q.scale_inv.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        bound = torch.maximum(w.abs() * 2.0**-4, s * 2.0**-10)
        assert ((deq - w).abs() <= bound * (1 + 1e-12)).all(), name


def _fake_te(fused: torch.Tensor, pow2: bool) -> TeBlockwiseTensor:
    """What TE stores for a 128x128 blockwise FP8 weight, with its padding filled with NaN."""
    t = to_te(quantize_blockwise(fused, (128, 128), fmt="e4m3", pow2_scales=pow2))
    s = t.rowwise_scale_inv.clone()
    kb = math.ceil(fused.shape[1] / 128)
    s[:, kb:] = float("nan")  # TE leaves padding uninitialised: must never be read
    return TeBlockwiseTensor(t.shape, True, t.rowwise_data, s, None, None)


@pytest.mark.megatron
@pytest.mark.parametrize("pow2", [True, False])
def test_te_layout_relayout_is_bit_identical(megatron_env, pow2):
    # head_dim 128 and FFN 384: every fused boundary is on a 128-row block boundary.
    model = _model(kv_channels=128, ffn_hidden_size=384)
    shape = ex.GptShape.from_megatron_config(model.config)
    recipe = (
        JETRL
        if pow2
        else JETRL.with_(
            train=JETRL.train.with_(pow2_weight_scales=False, pow2_activation_scales=False),
            rollout=JETRL.rollout.with_(pow2_weight_scales=False, pow2_activation_scales=False),
        )
    )
    _, master = ex.export_hf(model.state_dict(), shape, recipe)
    from_te: dict = {}
    for name, p in model.state_dict().items():
        if name.endswith(
            ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
        ):
            te = _fake_te(p, pow2)
            assert te.rowwise_scale_inv.shape[1] % 4 == 0  # TE's padded scale layout
            from_te.update(ex.te_fp8_to_hf(name, te, shape, pow2_scales=pow2))
    assert ex.parity_check(master, from_te) == []
    assert len(master) == 2 * len(LAYER_LINEARS)  # two layers
    # The check names what differs.
    name = "model.layers.1.mlp.up_proj.weight"
    bad = dict(from_te)
    d = bad[name].data.view(torch.uint8).clone()
    d[5, 7] ^= 1
    bad[name] = type(bad[name])(
        d.view(torch.float8_e4m3fn), bad[name].scale_inv, (128, 128), "e4m3", pow2
    )
    assert ex.parity_check(master, bad) == [f"{name}: 1 FP8 bytes and 0 block scales differ"]


@pytest.mark.megatron
def test_te_relayout_refuses_straddling_blocks(megatron_env):
    model = _model()  # head_dim 64: K and V of a group share a 128-row block
    shape = ex.GptShape.from_megatron_config(model.config)
    w = model.decoder.layers[0].self_attention.linear_qkv.weight
    with pytest.raises(ex.ExportError, match="straddle"):
        ex.te_fp8_to_hf(
            "decoder.layers.0.self_attention.linear_qkv.weight",
            _fake_te(w, True),
            shape,
            pow2_scales=True,
        )


def test_unknown_and_misshaped_parameters_are_named():
    shape = ex.GptShape(2, 4, 2, 64, 384)
    with pytest.raises(ex.ExportError, match=r"decoder\.layers\.0\.mlp\.router\.weight"):
        ex.megatron_to_hf({"decoder.layers.0.mlp.router.weight": torch.zeros(2, 2)}, shape)
    with pytest.raises(ex.ExportError, match=r"expected .* = 512"):
        ex.megatron_to_hf(
            {"module.decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(256, 8)},
            shape,
        )
    sd = {
        "decoder.layers.0.mlp.linear_fc2.weight": torch.ones(4, 384),
        "decoder.layers.0.mlp.linear_fc2._extra_state": torch.zeros(1),
    }
    out = ex.megatron_to_hf(sd, shape, layer_offset=5)
    assert list(out) == ["model.layers.5.mlp.down_proj.weight"]


@pytest.mark.gpu
def test_te_fp8_param_export_parity_on_gpu():
    """Real TE FP8 weights (fp8_param) re-laid out == quantizing their high-precision init values.

    Runs in the Docker image (scripts/run_gpu_tests.sh): TE spec, blockwise recipe, H100.
    """
    import transformer_engine.pytorch as te_pt
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron_shims import TinyGpt, gpt_config_fields

    from nemo_jetrl.megatron.config import build_te_recipe, build_transformer_config

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "nccl", init_method="tcp://127.0.0.1:29631", rank=0, world_size=1
        )
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    recipe = JETRL.with_(train=JETRL.train.with_(fp8_param=True))
    dims = TinyGpt(
        hidden_size=512, kv_channels=128, ffn_hidden_size=1024, vocab_size=1024, max_seq=128
    )
    cfg = build_transformer_config(
        recipe, **gpt_config_fields(dims), bf16=True, params_dtype=torch.bfloat16
    )
    te_recipe = build_te_recipe(recipe)
    with te_pt.fp8_model_init(
        enabled=True, recipe=te_recipe, preserve_high_precision_init_val=True
    ):
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True),
            vocab_size=dims.vocab_size,
            max_sequence_length=dims.max_seq,
        ).cuda()
    shape = ex.GptShape.from_megatron_config(cfg)
    from_te = ex.export_te_fp8_params(model, shape, recipe)
    masters = {
        n: (p.get_high_precision_init_val() if hasattr(p, "get_high_precision_init_val") else p)
        for n, p in model.named_parameters()
    }
    _, from_master = ex.export_hf({n: t.float().cpu() for n, t in masters.items()}, shape, recipe)
    assert ex.parity_check(from_master, from_te) == []
    parallel_state.destroy_model_parallel()
