"""TE's training blocks vs the rollout's: fused linear_qkv, tensor-parallel shards, export guards.

The training side's weight blocks are those of the tensor TE quantizes: Megatron's fused
``linear_qkv`` (q/k/v interleaved per KV group) and each tensor-parallel rank's shard. The
rollout quantizes each HF weight on its own (`export.export_hf`). Quantizing with our quantizer
(bit-exact to TE's blockwise rule, tests/megatron/test_te_layout_from_te.py) shows where the two
differ; `blocks.block_layout_problems` must refuse exactly those models.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron_shims import te_block_dequant as _deq

from nemo_jetrl.fp8 import quantize_blockwise
from nemo_jetrl.fp8.layouts import to_te
from nemo_jetrl.megatron import export as ex
from nemo_jetrl.megatron.blocks import block_layout_problem, block_layout_problems
from nemo_jetrl.recipe import Recipe

JETRL = Recipe.preset("jetrl")
FP32 = {"pow2_weight_scales": False, "pow2_activation_scales": False}
JETRL_FP32 = JETRL.with_(train=JETRL.train.with_(**FP32), rollout=JETRL.rollout.with_(**FP32))
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"


@pytest.fixture(scope="module")
def megatron_env():
    from megatron_shims import megatron_cpu

    with megatron_cpu():
        yield


@pytest.mark.megatron
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_qkv_blocks_are_the_rollouts_only_at_head_dim_128(megatron_env, head_dim):
    from megatron_shims import TinyGpt, build_gpt, gpt_config_fields

    from nemo_jetrl.megatron.config import MegatronRecipeError, build_transformer_config

    model = build_gpt(TinyGpt(kv_channels=head_dim))
    shape = ex.GptShape.from_megatron_config(model.config)
    sd = model.state_dict()
    _, rollout = ex.export_hf(sd, shape, JETRL_FP32)
    trained = ex.split_fused(QKV, _deq(sd[QKV]), shape)  # TE's blocks of the fused weight
    same = {
        p: torch.equal(
            trained[f"self_attn.{p}_proj.weight"],
            rollout[f"model.layers.0.self_attn.{p}_proj.weight"].dequantize(torch.float32),
        )
        for p in "qkv"
    }
    fields = gpt_config_fields(TinyGpt(kv_channels=head_dim))
    if head_dim == 128:
        assert same == {"q": True, "k": True, "v": True}
        build_transformer_config(JETRL_FP32, **fields)  # accepted
        return
    # head dim 64: a block of the fused weight holds k_g and v_g, the rollout's k_g0 and k_g1
    assert same == {"q": True, "k": False, "v": False}
    with pytest.raises(MegatronRecipeError, match=r"linear_qkv .*head_dim=64"):
        build_transformer_config(JETRL_FP32, **fields)
    # Kept BF16 by name on both sides, the fused QKV is no longer an FP8 tensor: accepted.
    words = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    named = JETRL_FP32.with_(
        train=JETRL_FP32.train.with_(bf16_layer_kws=words),
        rollout=JETRL_FP32.rollout.with_(bf16_layer_kws=words),
    )
    build_transformer_config(named, **fields)
    # A BF16 rollout has no FP8 blocks to match (the flow reports that mismatch itself).
    build_transformer_config(JETRL_FP32.with_(rollout=Recipe.preset("bf16").rollout), **fields)


def test_tensor_parallel_shards_cut_the_rollouts_blocks():
    """Megatron's column-parallel fc1 holds [gate_r; up_r] per rank; TE quantizes that shard."""
    torch.manual_seed(0)
    ffn, hidden, tp = 192, 256, 2
    gate, up = torch.randn(ffn, hidden), torch.randn(ffn, hidden) * 3
    local = ffn // tp
    rank_w = [
        torch.cat([gate[r * local : (r + 1) * local], up[r * local : (r + 1) * local]])
        for r in range(tp)
    ]
    trained_gate = torch.cat([_deq(w)[:local] for w in rank_w])
    assert not torch.equal(trained_gate, _deq(gate))  # the rollout quantizes gate_proj whole
    # Row-parallel fc2: each rank quantizes its ffn/TP activation columns 1x128 on its own.
    x = torch.randn(4, ffn) * torch.linspace(0.1, 4, ffn)
    full = quantize_blockwise(x, (1, 128), fmt="e4m3", pow2_scales=False).dequantize(torch.float32)
    ranks = [
        quantize_blockwise(
            x[:, r * local : (r + 1) * local], (1, 128), fmt="e4m3", pow2_scales=False
        )
        for r in range(tp)
    ]
    assert not torch.equal(torch.cat([q.dequantize(torch.float32) for q in ranks], 1), full)


QWEN3_4B = {  # Qwen3-4B: 32 heads, 8 KV groups, head dim 128, FFN 9728 (= 76 x 128)
    "num_layers": 36,
    "hidden_size": 2560,
    "num_attention_heads": 32,
    "num_query_groups": 8,
    "kv_channels": 128,
    "ffn_hidden_size": 9728,
    "gated_linear_unit": True,
}


@pytest.mark.megatron
def test_real_transformer_config_with_tensor_parallelism():
    from megatron.core.transformer.transformer_config import TransformerConfig

    ok = TransformerConfig(**QWEN3_4B, tensor_model_parallel_size=4)  # 2432 = 19 x 128 rows
    assert block_layout_problems(ok, JETRL.train) == []
    bad = TransformerConfig(**QWEN3_4B, tensor_model_parallel_size=8)  # 1216 = 9.5 x 128
    found = block_layout_problems(bad, JETRL.train)
    assert [f.split(" ")[0] for f in found] == ["mlp.linear_fc1", "mlp.linear_fc2"]
    assert "1216 rows per rank" in found[0] and "1216 per rank" in found[1]
    from nemo_jetrl.megatron.config import MegatronRecipeError, build_transformer_config

    with pytest.raises(
        MegatronRecipeError,
        match=r"set policy\.megatron_cfg\.tensor_model_parallel_size so each rank",
    ):
        build_transformer_config(JETRL, **QWEN3_4B, tensor_model_parallel_size=8)
    assert block_layout_problems(bad, Recipe.preset("bf16").train) == []  # BF16 training


def test_moe_shared_and_latent_attention_shards():
    moe = SimpleNamespace(
        num_layers=2,
        num_attention_heads=16,
        num_query_groups=4,
        kv_channels=128,
        hidden_size=2048,
        ffn_hidden_size=None,
        gated_linear_unit=True,
        num_moe_experts=8,
        moe_layer_freq=1,
        moe_ffn_hidden_size=384,
        moe_shared_expert_intermediate_size=768,
        tensor_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    )
    found = block_layout_problems(moe, JETRL.train)
    assert [f.split(" ")[0] for f in found] == []  # 384 / 1 and 768 / 2 = 384 rows: aligned
    moe.expert_tensor_parallel_size, moe.tensor_model_parallel_size = 2, 4
    found = [f.split(" ")[0] for f in block_layout_problems(moe, JETRL.train)]
    assert found == [
        "mlp.experts.linear_fc1",
        "mlp.experts.linear_fc2",
        "mlp.shared_experts.linear_fc1",
        "mlp.shared_experts.linear_fc2",
    ]
    mla = SimpleNamespace(
        num_layers=2,
        num_attention_heads=16,
        hidden_size=2048,
        multi_latent_attention=True,
        q_lora_rank=None,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
        ffn_hidden_size=1024,
        gated_linear_unit=True,
        tensor_model_parallel_size=8,  # 2 heads x 192 = 384 q rows per rank: aligned
    )
    assert block_layout_problems(mla, JETRL.train) == []
    mla.tensor_model_parallel_size = 16  # 192 q rows per rank
    assert "self_attention.linear_q_proj" in (block_layout_problem(mla, JETRL.train) or "")


@pytest.mark.megatron
def test_tensor_parallel_shards_are_not_exported_as_full_weights(megatron_env):
    """A TP rank's shard (half the KV groups of linear_qkv, half of linear_proj's input columns)
    is refused by name instead of being re-laid out into truncated HF weights."""
    from megatron_shims import TinyGpt, build_gpt

    model = build_gpt(TinyGpt(kv_channels=128))
    shape = ex.GptShape.from_megatron_config(model.config)
    sd = model.state_dict()
    shards = {
        QKV: sd[QKV][: sd[QKV].shape[0] // 2],  # rank 0 of TP=2: KV group 0
        "decoder.layers.0.self_attention.linear_proj.weight": sd[
            "decoder.layers.0.self_attention.linear_proj.weight"
        ][:, :256],
        "decoder.layers.0.mlp.linear_fc2.weight": sd["decoder.layers.0.mlp.linear_fc2.weight"][
            :, :192
        ],
    }
    for name, t in shards.items():
        layout = to_te(quantize_blockwise(t.contiguous(), (128, 128), fmt="e4m3", pow2_scales=True))
        with pytest.raises(ex.ExportError, match="tensor-parallel shard"):
            ex.te_fp8_to_hf(name, layout, shape, pow2_scales=True)
        if not name.endswith("linear_qkv.weight"):
            with pytest.raises(ex.ExportError, match="tensor-parallel shard"):
                ex.megatron_to_hf({name: t}, shape)
    full = {n: sd[n] for n in shards}
    assert len(ex.megatron_to_hf(full, shape)) == 5  # q, k, v, o_proj, down_proj


def test_only_the_layers_that_run_fp8_are_judged_dense_and_moe_apart():
    """A dense MLP exists only in the dense layers (``moe_layer_freq``) and is judged there only:
    DeepSeek-V2-Lite's shape (dense layer 0 of 10944 rows, MoE after) at tensor-parallel 2 kept
    its dense layer BF16 (first layer BF16) and was still called off (diff review, session 38);
    routed experts are judged only where an MoE layer runs FP8."""
    from types import SimpleNamespace

    from nemo_jetrl.megatron.blocks import block_layout_problem, block_layout_problems

    v2lite = SimpleNamespace(
        num_layers=4,
        hidden_size=2048,
        num_attention_heads=16,
        kv_channels=128,
        ffn_hidden_size=10944,  # 5472 rows a rank at TP 2: off 128
        gated_linear_unit=True,
        tensor_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        num_moe_experts=64,
        moe_ffn_hidden_size=1408,
        moe_shared_expert_intermediate_size=2816,
        moe_layer_freq=[0, 1, 1, 1],
    )
    train = JETRL_FP32.train
    found = block_layout_problems(v2lite, train)  # layer 0's dense MLP: fc1 and fc2
    assert [p.split(" ")[0] for p in found] == ["mlp.linear_fc1", "mlp.linear_fc2"], found
    first_bf16 = train.with_(bf16_first_layers=1)
    assert block_layout_problems(v2lite, first_bf16) == []
    by_name = train.with_(bf16_layer_kws=("model.layers.0.mlp",))
    assert block_layout_problems(v2lite, by_name) == []
    # experts whose rows a rank cuts, only in MoE layers that run FP8
    # 11008 / 2 = 5504 = 43 x 128 dense rows a rank; 1408 / 4 = 352 expert rows a rank
    moe_cut = SimpleNamespace(**{**vars(v2lite), "ffn_hidden_size": 11008,
                                 "expert_tensor_parallel_size": 4})  # fmt: skip
    found = block_layout_problems(moe_cut, train)
    assert found and all(p.startswith("mlp.experts") for p in found), found
    msg = block_layout_problem(moe_cut, train)
    assert "set policy.megatron_cfg.expert_tensor_parallel_size so each rank" in msg
    assert "BF16 on both sides by name" not in msg  # experts cannot be
    assert block_layout_problems(moe_cut, train.with_(bf16_last_layers=3)) == []
