"""Routed experts split over vLLM ranks without vLLM (vllm_patch/expert_shards.py).

The engine half (a real vLLM 0.32 CPU engine at tensor_parallel_size=2, experts tensor- and
expert-parallel) is test_vllm_moe_shards.py. Here the layer is a labelled stand-in carrying
only what the helpers read from vLLM's layer (``moe_config.moe_parallel_config``, the fused
parameters, ``_expert_map``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_jetrl.fp8 import quantize_blockwise
from nemo_jetrl.vllm_patch.expert_shards import (
    hf_slice,
    local_routes,
    rank_expected,
    shard_problems,
    sorted_routes,
)
from nemo_jetrl.vllm_patch.experts import experts_forward
from nemo_jetrl.vllm_patch.kernel import ensure_ops
from nemo_jetrl.vllm_patch.moe_names import NotLocalExpert, resolve_expert_tensor

E, H, INTER, M, TOPK = 8, 256, 256, 11, 2


def _linear_map(rank: int, ep: int = 2) -> torch.Tensor:
    """vLLM's linear placement (expert_map_manager.determine_expert_map, E % ep == 0)."""
    per = E // ep
    return torch.tensor([j - per * rank if j // per == rank else -1 for j in range(E)])


class _StandinExperts(torch.nn.Module):
    """STAND-IN for vLLM's RoutedExperts / FusedMoE: the attributes expert_shards reads."""

    def __init__(self, tp=(1, 0), ep=(1, 0), dp=1, i_part=INTER, experts=E):
        super().__init__()
        par = SimpleNamespace(
            tp_size=tp[0], tp_rank=tp[1], ep_size=ep[0], ep_rank=ep[1], dp_size=dp, pcp_size=1,
            enable_eplb=False,
        )  # fmt: skip
        self.moe_config = SimpleNamespace(
            moe_parallel_config=par, intermediate_size_per_partition=i_part,
            intermediate_size_per_partition_unpadded=i_part,
        )  # fmt: skip
        f8 = torch.float8_e4m3fn
        self.w13_weight = torch.nn.Parameter(torch.zeros(experts, 2 * i_part, H, dtype=f8), False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(experts, H, i_part, dtype=f8), False)
        self.w13_weight_scale_inv = torch.nn.Parameter(
            torch.ones(experts, 2 * i_part // 128, H // 128), False
        )
        self.w2_weight_scale_inv = torch.nn.Parameter(
            torch.ones(experts, H // 128, i_part // 128), False
        )
        self._expert_map = _linear_map(ep[1], ep[0]) if ep[0] > 1 else None


def _model(layer: torch.nn.Module) -> torch.nn.Module:
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
    root.model.layers[1].mlp = torch.nn.Module()
    root.model.layers[1].mlp.experts = layer
    return root


def kept(model: torch.nn.Module, full: dict) -> tuple[dict, int]:
    """What the refit hook keeps of ``full`` for the parity check on this rank (its part of
    each tensor, host copies) and how many tensors it left to other ranks."""
    from nemo_jetrl.backends.nemo_rl.refit_batches import SentTensors

    sent = SentTensors()
    for name, t in full.items():
        sent.keep_part(model, sent.fp8, name, t)
    return sent.fp8, sent.elsewhere


def _weights(seed: int, pow2: bool = True):
    g = torch.Generator().manual_seed(seed)
    q13 = [quantize_blockwise(torch.randn(2 * INTER, H, generator=g) * 0.05, (128, 128),
                              pow2_scales=pow2) for _ in range(E)]  # fmt: skip
    q2 = [quantize_blockwise(torch.randn(H, INTER, generator=g) * 0.05, (128, 128),
                             pow2_scales=pow2) for _ in range(E)]  # fmt: skip
    stack = [torch.stack([getattr(q, a) for q in qs]) for qs in (q13, q2)
             for a in ("data", "scale_inv")]  # fmt: skip
    return stack


@pytest.mark.parametrize("w_pow2", [True, False], ids=["grouped", "mixed-scales-loop"])
@pytest.mark.parametrize("rank", [0, 1])
def test_ep_rank_computes_its_experts_exactly_as_the_full_layer_would(rank, w_pow2):
    """An expert-parallel rank (4 local experts of 8, global ids remapped by vLLM's expert_map)
    gives bit for bit the full layer's output with the other rank's experts weighted 0: the
    same rows, order and sums; the other ranks' routes contribute nothing."""
    w13, s13, w2, s2 = _weights(0, w_pow2)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(M, H, generator=g) * 2).to(torch.bfloat16)
    ids = torch.randint(0, E, (M, TOPK), generator=g)
    ids[:, 1] = (ids[:, 0] + 3) % E  # two distinct experts per token
    wts = torch.rand(M, TOPK, generator=g)
    emap = _linear_map(rank)
    mine = slice(4 * rank, 4 * rank + 4)
    kw = dict(pow2=True, w_pow2=w_pow2, eps=0.0, backend="reference")
    got = experts_forward(ensure_ops(), x, w13[mine], s13[mine], w2[mine], s2[mine], wts, ids,
                          expert_map=emap, **kw)  # fmt: skip
    local = (emap[ids] >= 0).float()
    assert 0 < local.sum() < M * TOPK  # both ranks hold some of these routes
    want = experts_forward(ensure_ops(), x, w13, s13, w2, s2, wts * local, ids, **kw)
    assert torch.equal(got, want)
    other = experts_forward(ensure_ops(), x, w13, s13, w2, s2, wts * (1 - local), ids, **kw)
    assert not torch.equal(got, other)


def test_local_routes_drop_experts_held_elsewhere():
    ids = torch.tensor([[0, 5], [7, 3], [4, 6]], dtype=torch.int32)
    wts = torch.tensor([[0.5, 0.25], [0.125, 1.0], [2.0, 4.0]])
    flat, token, weight = local_routes(ids, wts, _linear_map(1))
    assert flat.tolist() == [1, 3, 0, 2] and token.tolist() == [0, 1, 2, 2]
    assert weight.tolist() == [0.25, 0.125, 2.0, 4.0]
    flat, token, weight = local_routes(ids, wts, None)  # no expert parallel: all of them
    assert flat.tolist() == [0, 5, 7, 3, 4, 6] and token.tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("ep", [False, True])
def test_sorted_routes_are_the_local_routes_sorted_by_expert(ep):
    """Without expert parallelism a sorted row's token is taken as its flat index // k (no token
    table); with it, `local_routes`' table is gathered: the same (ids, token, weight) either way
    as sorting `local_routes` stably by expert, ties in token order."""
    g = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(M)]).to(torch.int32)
    wts = torch.rand(M, TOPK, generator=g)
    emap = _linear_map(1) if ep else None
    flat, token, weight = local_routes(ids, wts, emap)
    order = torch.argsort(flat, stable=True)
    got = sorted_routes(ids, wts, emap)
    for a, b in zip(got, (flat[order], token[order], weight[order]), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_down_input_blocks_are_trainings_iff_the_tp_shard_is_128_aligned():
    """Why the rule is I/tp % 128 == 0: a TP rank quantizes its slice of the down projection's
    input in 1x128 blocks; for 128-wide slices those are training's blocks of the full row,
    bit for bit; for 64-wide slices a half block's amax (so its scale) is not training's."""
    g = torch.Generator().manual_seed(4)
    act = (torch.randn(5, 256, generator=g) * torch.logspace(2, 0, 256)).to(torch.bfloat16)
    full = quantize_blockwise(act, (1, 128), pow2_scales=True)

    def same(per: int, r: int) -> bool:
        part = quantize_blockwise(act[:, r * per : (r + 1) * per], (1, 128), pow2_scales=True)
        want = full.data[:, r * per : (r + 1) * per]
        return torch.equal(part.data.view(torch.uint8), want.view(torch.uint8))

    assert all(same(128, r) for r in range(2))
    assert not all(same(64, r) for r in range(4))


def test_shard_problems_refuse_unaligned_tp_and_vllm_data_parallel():
    assert shard_problems(_StandinExperts(tp=(2, 1), i_part=128)) == []
    assert shard_problems(_StandinExperts(ep=(2, 1), experts=4)) == []
    (msg,) = shard_problems(_StandinExperts(tp=(8, 3), i_part=192))
    assert msg.startswith("tensor parallel 8 gives each rank 192 of the expert intermediate size")
    assert "1536, not a multiple of 128" in msg and "expert_parallel_size" in msg
    (msg,) = shard_problems(_StandinExperts(ep=(4, 0), dp=2, experts=2))
    assert "vLLM data parallel 2" in msg and "expert_parallel_size > tensor_parallel_size" in msg


def test_tp_rank_resolves_and_expects_its_shard_of_each_expert_tensor():
    """TP rank 1 of 2: gate/up rows and down columns 128.., weight and 128x128 scales alike;
    the engine slice resolve_expert_tensor reads has exactly the expected shard's shape."""
    model = _model(_StandinExperts(tp=(2, 1), i_part=INTER // 2))
    base = "model.layers.1.mlp.experts.6"
    layer = model.model.layers[1].mlp.experts
    assert hf_slice(layer, "gate_proj", (INTER, H)) == (0, 128, 128)
    assert hf_slice(layer, "down_proj", (H, INTER)) == (1, 128, 128)
    full = {
        f"{base}.up_proj.weight": torch.arange(INTER * H).reshape(INTER, H),
        f"{base}.up_proj.weight_scale_inv": torch.arange(4.0).reshape(2, 2),
        f"{base}.down_proj.weight": torch.arange(H * INTER).reshape(H, INTER),
        f"{base}.down_proj.weight_scale_inv": torch.arange(4.0).reshape(2, 2),
        "model.norm.weight": torch.ones(H),
    }
    mine, elsewhere = kept(model, full)
    assert elsewhere == 0
    assert torch.equal(mine[f"{base}.up_proj.weight"], full[f"{base}.up_proj.weight"][128:])
    assert mine[f"{base}.up_proj.weight_scale_inv"].tolist() == [[2.0, 3.0]]
    assert torch.equal(mine[f"{base}.down_proj.weight"], full[f"{base}.down_proj.weight"][:, 128:])
    assert mine[f"{base}.down_proj.weight_scale_inv"].tolist() == [[1.0], [3.0]]
    assert torch.equal(mine["model.norm.weight"], full["model.norm.weight"])
    for name in (f"{base}.up_proj.weight", f"{base}.down_proj.weight"):
        # the host copy holds the shard's bytes only (not a view into a copy of the whole)
        assert mine[name].untyped_storage().nbytes() == full[name].nbytes // 2, name
    for name in (n for n in full if ".experts." in n):
        _, p, start, rows = resolve_expert_tensor(model, name)
        assert tuple(p[start : start + rows].shape) == tuple(mine[name].shape), name


def test_ep_rank_maps_global_ids_and_leaves_out_experts_held_elsewhere():
    model = _model(_StandinExperts(ep=(2, 1), experts=4))
    layer = model.model.layers[1].mlp.experts
    layer.w2_weight.data.view(torch.uint8)[1] = 7  # local 1 = global expert 5
    _, p, _, _ = resolve_expert_tensor(model, "model.layers.1.mlp.experts.5.down_proj.weight")
    assert bool((p.view(torch.uint8) == 7).all())
    with pytest.raises(NotLocalExpert, match=r"experts\.2\.down_proj\.weight: expert 2 is held by"):
        resolve_expert_tensor(model, "model.layers.1.mlp.experts.2.down_proj.weight")
    t = torch.ones(H, INTER)
    assert rank_expected(model, "model.layers.1.mlp.experts.2.down_proj.weight", t) is None
    assert rank_expected(model, "model.layers.1.mlp.experts.4.down_proj.weight", t) is t
    names = [f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(E)]
    mine, elsewhere = kept(model, dict.fromkeys(names, t))
    assert elsewhere == 4 and sorted(mine) == names[4:]


def test_refit_batch_of_an_ep_rank_takes_every_expert_and_sends_them_on():
    """NeMo-RL streams all 8 experts to each rank; an expert-parallel rank (4 held) refuses
    none of them (vLLM's loader skips the other rank's) and keeps a host copy of its own 4 for
    the parity check, counting the rest (host memory: its share, not the whole layer)."""
    from nemo_jetrl.backends.nemo_rl.refit_batches import SentTensors, quantize_batch
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import settings_from_recipe

    model = _model(_StandinExperts(ep=(2, 0), experts=4))
    g = torch.Generator().manual_seed(5)
    names = [f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(E) for p in
             ("gate_proj", "up_proj", "down_proj")]  # fmt: skip
    batch = [(n, torch.randn(H, INTER, generator=g).to(torch.bfloat16)) for n in names]
    sent = SentTensors()
    out = quantize_batch(batch, model, settings_from_recipe(Recipe.preset("jetrl")), sent)
    assert len(out) == 2 * len(names) and len(sent.fp8) == len(names)
    assert sent.elsewhere == 4 * 3 * 2
    assert {n.split(".")[5] for n in sent.fp8} == {"0", "1", "2", "3"}
