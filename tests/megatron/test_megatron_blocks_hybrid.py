"""TE's training blocks vs the rollout's for Qwen3.5 / Qwen3-Next layouts (megatron-core 0.16.1).

Gated attention (``attention_output_gate``): ``linear_qkv`` holds per KV group ``[q heads | gate
heads | k | v]`` while HF's q_proj holds ``[q; gate]`` per head. The gated delta net's ``in_proj``
is ONE GEMM holding ``[q_r; k_r; v_r; z_r; b_r; a_r]`` a rank, where the rollout quantizes
Qwen3.5's in_proj_qkv/z/b/a or Qwen3-Next's in_proj_qkvz/ba each on its own. The layouts are read
off the real megatron-core modules (SelfAttention's split, GatedDeltaNet's sharded_state_dict);
quantizing each rank's tensor as TE does and each HF weight as the rollout does shows where the
blocks differ, and `blocks.block_layout_problems` on a real TransformerConfig must name exactly
those (a first version of the config-time rule skipped both families).
"""

from __future__ import annotations

import pytest
import torch
from megatron_shims import te_block_dequant as _deq

from nemo_jetrl.megatron.blocks import (
    HF_SPLIT_FIELD,
    block_layout_problem,
    block_layout_problems,
    with_hf_split,
)
from nemo_jetrl.recipe import Recipe

pytestmark = pytest.mark.megatron
JETRL = Recipe.preset("jetrl")
HIDDEN = 128


@pytest.fixture(scope="module")
def megatron_env():
    from megatron_shims import megatron_cpu

    with megatron_cpu():
        yield


def _pool(rows: dict[str, int]) -> tuple[torch.Tensor, dict[str, slice]]:
    """The HF weights stacked (each at its own scale, so mixed blocks change amax), and where."""
    torch.manual_seed(0)
    parts, where, at = [], {}, 0
    for i, (name, n) in enumerate(rows.items()):
        parts.append(torch.randn(n, HIDDEN) * (1 + 2 * i))
        where[name], at = slice(at, at + n), at + n
    return torch.cat(parts), where


def _trained_is_rolled(pool, where, ranks: list[torch.Tensor]) -> dict[str, bool]:
    """Per HF weight: TE's blocks of every rank's local tensor (``ranks``: pool row indices)
    dequantize to what quantizing the HF weight on its own gives."""
    back = torch.empty_like(pool)
    for idx in ranks:
        back[idx] = _deq(pool[idx])
    return {n: torch.equal(back[s], _deq(pool[s])) for n, s in where.items()}


def _config(tp: int, **fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    # an MLP of 1024 rows: whole 128-blocks a rank up to TP 8 (only the mixers are judged here)
    return TransformerConfig(
        num_layers=4, hidden_size=HIDDEN, ffn_hidden_size=1024, gated_linear_unit=True,
        tensor_model_parallel_size=tp, **fields,
    )  # fmt: skip


# -- gated attention ---------------------------------------------------------------------------


def _qkv_order(heads: int, groups: int, hd: int, gate: bool) -> torch.Tensor:
    """Rows of [q_proj; k_proj; v_proj] in Megatron's linear_qkv order (per KV group: q heads,
    gate heads, k, v; HF's gated q_proj is [q; gate] per head)."""
    per_q = 2 * hd if gate else hd
    q = torch.arange(heads * per_q).view(heads, -1, hd)
    k = heads * per_q + torch.arange(groups * hd).view(groups, hd)
    v = heads * per_q + groups * hd + torch.arange(groups * hd).view(groups, hd)
    npg, out = heads // groups, []
    for g in range(groups):
        hs = slice(g * npg, (g + 1) * npg)
        out += [q[hs, 0].flatten()] + ([q[hs, 1].flatten()] if gate else []) + [k[g], v[g]]
    return torch.cat(out)


def test_real_gated_attention_holds_q_gate_k_v_per_group(megatron_env):
    """The layout `_qkv_order` writes is what megatron-core's SelfAttention splits into query,
    gate, key and value (q/k norms bypassed to compare the projections)."""
    from megatron_shims import TinyGpt, build_gpt

    heads, groups, hd = 4, 2, 32
    model = build_gpt(
        TinyGpt(hidden_size=HIDDEN, num_attention_heads=heads, num_query_groups=groups,
                kv_channels=hd),
        attention_output_gate=True,
    )  # fmt: skip
    attn = model.decoder.layers[0].self_attention
    attn.q_layernorm = attn.k_layernorm = torch.nn.Identity()
    q_proj, k_proj, v_proj = (torch.randn(n * hd, HIDDEN) for n in (2 * heads, groups, groups))
    with torch.no_grad():
        attn.linear_qkv.weight.copy_(
            torch.cat([q_proj, k_proj, v_proj])[_qkv_order(4, 2, hd, True)]
        )
    x = torch.randn(3, 1, HIDDEN)
    query, key, value, gate = attn.get_query_key_value_tensors(x, output_gate=True)
    hf_q = (x @ q_proj.T).view(3, 1, heads, 2, hd)
    assert torch.allclose(query, hf_q[..., 0, :], atol=1e-5)
    assert torch.allclose(gate, hf_q[..., 1, :], atol=1e-5)
    assert torch.allclose(key, (x @ k_proj.T).view(3, 1, groups, hd), atol=1e-5)
    assert torch.allclose(value, (x @ v_proj.T).view(3, 1, groups, hd), atol=1e-5)


@pytest.mark.parametrize(
    ("heads", "groups", "hd", "tp", "gate", "cut"),
    [
        (4, 2, 128, 1, True, False),  # whole groups of 128-row heads
        (4, 2, 256, 2, True, False),  # Qwen3.5's head dim, a group a rank
        (8, 2, 128, 4, True, False),  # fewer groups than ranks: (16 + 4) x 128 / 4 = 640
        (8, 2, 64, 1, True, True),  # head dim 64: a block holds two heads' q (or gate, k + v)
        (16, 2, 128, 8, True, True),  # (32 + 4) x 128 / 8 = 576 rows a rank: part of a group
        (16, 2, 128, 8, False, True),  # the same without the gate: 2560 / 8 = 320
        (8, 2, 128, 8, False, True),  # 1536 / 8 = 192
    ],
)
def test_gated_linear_qkv_blocks_are_named_exactly_where_they_differ(
    heads, groups, hd, tp, gate, cut
):
    order = _qkv_order(heads, groups, hd, gate)
    rows = {"q_proj": heads * hd * (2 if gate else 1), "k_proj": groups * hd, "v_proj": groups * hd}
    pool, where = _pool(rows)
    same = _trained_is_rolled(pool, where, list(order.chunk(tp)))  # column-parallel row ranges
    cfg = _config(tp, num_attention_heads=heads, num_query_groups=groups, kv_channels=hd,
                  attention_output_gate=gate)  # fmt: skip
    named = [p for p in block_layout_problems(cfg, JETRL.train) if "linear_qkv" in p]
    assert (not all(same.values())) == cut == bool(named), (same, named)
    if cut and hd % 128:
        assert f"head_dim={hd}" in named[0] and "[q heads | gate heads | k | v]" in named[0]
    elif cut:  # a shard edge: the tensor-parallel size is a way out
        assert f"tensor_model_parallel_size={tp} = " in named[0], named
        assert "set policy.megatron_cfg.tensor_model_parallel_size" in block_layout_problem(
            cfg, JETRL.train
        )


# -- the gated delta net ------------------------------------------------------------------------

SPLIT = {True: ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), False: ("in_proj_qkvz", "in_proj_ba")}  # fmt: skip


def _gdn(tp: int, nk: int, hk: int, nv: int, hv: int, **fields):
    fields = {"num_attention_heads": 4, "kv_channels": 128, **fields}
    return _config(
        tp, attention_output_gate=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
        linear_num_key_heads=nk, linear_key_head_dim=hk, linear_num_value_heads=nv,
        linear_value_head_dim=hv, **fields,
    )  # fmt: skip


def test_real_gated_delta_net_computes_q_k_v_z_b_a_as_one_in_proj(megatron_env):
    """megatron-core's GatedDeltaNet: one in_proj weight, split per rank into
    [query; key; value; z; beta; alpha] (its sharded_state_dict), which `_in_proj_ranks` lays
    out; out_proj takes the value heads' columns."""
    from megatron_shims import build_gated_delta_net

    cfg = _gdn(1, 2, 32, 4, 16, use_cpu_initialization=True, params_dtype=torch.float32)
    attn = build_gated_delta_net(cfg)
    factory = attn.sharded_state_dict(prefix="")["in_proj.weight"]
    parts = factory.build_fn(factory.key, attn.in_proj.weight.detach(), factory.replica_id, None)
    assert [(p.key.rsplit(".", 1)[1], p.data.shape[0]) for p in parts] == [
        ("query", 64), ("key", 64), ("value", 64), ("z", 64), ("beta", 4), ("alpha", 4),
    ]  # fmt: skip
    assert tuple(attn.out_proj.weight.shape) == (HIDDEN, 4 * 16)


def _in_proj_ranks(split: bool, tp: int, nk: int, hk: int, nv: int, hv: int):
    """(HF weights' rows, each rank's local in_proj as rows of those weights stacked)."""
    kd, vd, g = nk * hk, nv * hv, nv // nk
    if split:  # Qwen3.5: in_proj_qkv = [q; k; v], then z, b, a
        rows = dict(zip(SPLIT[True], (2 * kd + vd, vd, nv, nv), strict=True))
        q = torch.arange(kd).view(nk, hk)
        k, v = kd + q, 2 * kd + torch.arange(vd).view(nv, hv)
        z = 2 * kd + vd + torch.arange(vd).view(nv, hv)
        b = 2 * kd + 2 * vd + torch.arange(nv)
        a = b + nv
    else:  # Qwen3-Next: per key head [q_i; k_i; v; z of its g value heads], [b; a] likewise
        rows = dict(zip(SPLIT[False], (2 * kd + 2 * vd, 2 * nv), strict=True))
        qkvz = torch.arange(2 * kd + 2 * vd).view(nk, -1)
        q, k = qkvz[:, :hk], qkvz[:, hk : 2 * hk]
        v = qkvz[:, 2 * hk : 2 * hk + g * hv].reshape(nv, hv)
        z = qkvz[:, 2 * hk + g * hv :].reshape(nv, hv)
        ba = 2 * kd + 2 * vd + torch.arange(2 * nv).view(nk, 2 * g)
        b, a = ba[:, :g].reshape(nv), ba[:, g:].reshape(nv)
    ks, vs = nk // tp, nv // tp
    ranks = [
        torch.cat([x[r * n : (r + 1) * n].flatten() for x, n in
                   ((q, ks), (k, ks), (v, vs), (z, vs), (b, vs), (a, vs))])
        for r in range(tp)
    ]  # fmt: skip
    return rows, ranks


@pytest.mark.parametrize(
    ("split", "tp", "nk", "hk", "cut"),
    [
        (True, 1, 2, 128, True),  # Qwen3.5: b and a share a block the rollout splits
        (True, 2, 2, 128, True),
        (False, 1, 2, 128, False),  # Qwen3-Next: b, a are all of in_proj_ba, one block
        (False, 2, 2, 128, True),  # a rank holds half of in_proj_ba's block
        (False, 1, 2, 64, True),  # key head dim 64: a block holds q_0 and q_1, apart in HF
    ],
)
def test_gdn_in_proj_blocks_are_named_exactly_where_they_differ(split, tp, nk, hk, cut):
    nv, hv = 4, 128
    rows, ranks = _in_proj_ranks(split, tp, nk, hk, nv, hv)
    pool, where = _pool(rows)
    same = _trained_is_rolled(pool, where, ranks)
    cfg = _gdn(tp, nk, hk, nv, hv)
    setattr(cfg, HF_SPLIT_FIELD, split)  # what flow.megatron_layout passes from the arch
    named = [p for p in block_layout_problems(cfg, JETRL.train) if "in_proj" in p]
    assert (not all(same.values())) == cut == bool(named), (same, named)
    if not cut:
        return
    assert named[0].startswith(f"self_attention.in_proj (linear_attn.{'/'.join(SPLIT[split])})")
    msg = block_layout_problem(cfg, JETRL.train)
    assert "keep ['linear_attn.in_proj'] BF16 on both sides" in msg
    # a smaller tensor-parallel size helps only where TP 1 gives the rollout's blocks
    tp_helps = not split and hk % 128 == 0
    assert ("set policy.megatron_cfg.tensor_model_parallel_size" in msg) == tp_helps, msg
    if split:
        assert "in_proj_b rows 0-" in named[0] and " + in_proj_a rows 0-" in named[0]
    # kept BF16 by name on the training side (and so on both), in_proj is not judged
    kept = JETRL.train.with_(bf16_layer_kws=("linear_attn.in_proj",))
    assert not [p for p in block_layout_problems(cfg, kept) if "in_proj" in p]


def test_without_the_hf_split_in_proj_is_judged_only_where_both_splits_agree():
    """A real TransformerConfig does not say which HF split the checkpoint has: at TP 1
    Qwen3.5's is cut and Qwen3-Next's is not (unjudged), at TP 2 both are (named). The policy
    worker is told the split by the driver (`with_hf_split`; an unknown model: none)."""
    tp1 = _gdn(1, 2, 128, 4, 128)
    assert not [p for p in block_layout_problems(tp1, JETRL.train)]
    found = block_layout_problems(_gdn(2, 2, 128, 4, 128), JETRL.train)
    assert len(found) == 1 and found[0].startswith("self_attention.in_proj (linear_attn.in_proj_*)")
    assert "Qwen3.5's HF split" in found[0] and "Qwen3-Next's HF split" in found[0]
    # the worker's view, told the split: Qwen3.5's TP-1 cut is named, Qwen3-Next's fit is not
    found = block_layout_problems(with_hf_split(tp1, True), JETRL.train)
    assert len(found) == 1 and found[0].startswith(
        "self_attention.in_proj (linear_attn.in_proj_qkv/in_proj_z/in_proj_b/in_proj_a)"
    )
    assert "in_proj_b rows 0-3 + in_proj_a rows 0-3" in found[0], found[0]
    assert block_layout_problems(with_hf_split(tp1, False), JETRL.train) == []
    assert with_hf_split(tp1, None) is tp1
    assert not hasattr(tp1, HF_SPLIT_FIELD)  # the live model's config is read, not written


def test_out_proj_and_each_mixer_in_its_own_layers():
    """out_proj's value-head columns cut per rank like linear_proj's; the attention linears are
    judged in the full-attention layers (linear_attention_freq=4: layer 3), the gated delta
    net's in the others."""
    # 4 value heads of 64 = 256 input columns / TP 4 = 64 a rank
    cfg = _gdn(4, 4, 128, 4, 64, num_query_groups=2)
    setattr(cfg, HF_SPLIT_FIELD, False)
    found = [p.split(" (")[0] for p in block_layout_problems(cfg, JETRL.train)]
    assert "self_attention.out_proj" in found
    assert "256 input columns / tensor_model_parallel_size=4 = 64 per rank" in (
        block_layout_problem(cfg, JETRL.train)
    )
    # 16 heads, 2 groups at TP 8: linear_qkv cut, in_proj (Qwen3.5) cut
    cfg = _gdn(8, 8, 128, 8, 128, num_attention_heads=16, num_query_groups=2)
    setattr(cfg, HF_SPLIT_FIELD, True)
    both = ["self_attention.linear_qkv", "self_attention.in_proj"]
    assert [p.split(" (")[0] for p in block_layout_problems(cfg, JETRL.train)] == both
    last_bf16 = JETRL.train.with_(bf16_last_layers=1)  # layer 3, the only full attention
    assert [p.split(" (")[0] for p in block_layout_problems(cfg, last_bf16)] == both[1:]
    first_three = JETRL.train.with_(bf16_first_layers=3)  # every gated delta net layer
    assert [p.split(" (")[0] for p in block_layout_problems(cfg, first_three)] == both[:1]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_qwen35_9b_real_config_names_only_in_proj(tp):
    """Qwen3.5-9B's shape as Megatron-Bridge configures it (gated attention of 16/4 heads of 256,
    every 4th layer full attention, 16/32 linear heads of 128, MLP 12288): its gated q/k/v,
    o_proj, out_proj and MLP are whole 128-blocks a rank up to TP 8; in_proj's b and a are not,
    and with ``linear_attn.in_proj`` BF16 training's blocks are the rollout's."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=32, hidden_size=4096, ffn_hidden_size=12288, gated_linear_unit=True,
        num_attention_heads=16, num_query_groups=4, kv_channels=256, attention_output_gate=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
        linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=32,
        linear_value_head_dim=128, tensor_model_parallel_size=tp,
    )  # fmt: skip
    setattr(cfg, HF_SPLIT_FIELD, True)
    found = block_layout_problems(cfg, JETRL.train)
    assert [p.split(" (")[0] for p in found] == ["self_attention.in_proj"], found
    assert f"in_proj_b rows 0-{32 // tp - 1} + in_proj_a rows 0-{32 // tp - 1}" in found[0]
    kept = JETRL.train.with_(bf16_layer_kws=("linear_attn.in_proj",))
    assert block_layout_problems(cfg, kept) == []
