"""Edges of routed experts split over vLLM ranks (vllm_patch/expert_shards.py, experts.py).

Routes to experts held on other ranks, in every serving branch: the host-read branch drops
them; the CUDA-graph-capture branch (no host read allowed) keeps them on local expert 0 with
weight 0. No CPU tensor is ever captured, so the capture branch is driven here through a
STAND-IN of its check (``expert_shards.capturing`` patched to True: what it returns on a
capturing CUDA stream); the GPU run of the branch is tests/vllm_patch/test_vllm_moe_shards.py
on a GPU engine (not here). The experts layer is the labelled stand-in of
test_expert_shards_unit.py (only the attributes the helpers read from vLLM's layer)."""

from __future__ import annotations

import pytest
import torch
from test_expert_shards_unit import INTER, E, H, _linear_map, _model, _StandinExperts, _weights

from nemo_jetrl.vllm_patch import expert_shards
from nemo_jetrl.vllm_patch.expert_shards import (
    fused_dtype,
    local_expert,
    local_routes,
    rank_expected,
    shard_problems,
)
from nemo_jetrl.vllm_patch.experts import experts_forward
from nemo_jetrl.vllm_patch.kernel import ensure_ops
from nemo_jetrl.vllm_patch.moe_names import resolve_expert_tensor


def _routes(seed: int, m: int = 13, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Two distinct experts per token; none to global 1 and 6 (local 1 on rank 0, local 2 on
    rank 1: an expert without tokens between experts with tokens on each rank)."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor([0, 2, 3, 4, 5, 7])
    ids = torch.stack([used[torch.randperm(6, generator=g)[:k]] for _ in range(m)])
    ids[0] = torch.tensor([4, 5])  # a token with both experts on rank 1 only
    ids[1] = torch.tensor([0, 3])  # ... and one with both on rank 0 only
    return ids, torch.rand(m, k, generator=g) + 0.25


def test_capture_branch_keeps_every_route_on_local_expert_0_with_weight_0(monkeypatch):
    """STAND-IN of the capture check: every (token, slot) stays, in token order; a route to an
    expert held elsewhere becomes local expert 0 with weight exactly 0; local ones keep their
    id and weight."""
    ids, wts = _routes(2)
    emap = _linear_map(1)  # rank 1 holds global 4..7 as local 0..3
    eager = local_routes(ids, wts, emap)
    monkeypatch.setattr(expert_shards, "capturing", lambda t: True)
    flat, token, weight = local_routes(ids, wts, emap)
    m, k = ids.shape
    assert token.tolist() == [t for t in range(m) for _ in range(k)]
    here = emap[ids.reshape(-1)] >= 0
    assert flat.tolist() == emap[ids.reshape(-1)].clamp(min=0).tolist()
    assert torch.equal(weight[~here], torch.zeros(int((~here).sum())))
    assert torch.equal(weight[here], wts.reshape(-1)[here].float())
    assert [t[here].tolist() for t in (flat, token, weight)] == [t.tolist() for t in eager]


@pytest.mark.parametrize("w_pow2", [True, False], ids=["grouped", "mixed-scales-loop"])
@pytest.mark.parametrize("rank", [0, 1])
def test_every_serving_branch_gives_the_rank_the_same_bits(monkeypatch, rank, w_pow2):
    """An expert-parallel rank's output is the same, bit for bit, in the host-read branch and
    the capture branch (stand-in), and equals the full layer with the other rank's routes
    weighted 0; the tokens routed only to the other rank's experts get exactly 0."""
    w13, s13, w2, s2 = _weights(3, w_pow2)
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(13, H, generator=g) * 2).to(torch.bfloat16)
    ids, wts = _routes(5)
    emap = _linear_map(rank)
    mine = slice(4 * rank, 4 * rank + 4)
    kw = dict(pow2=True, w_pow2=w_pow2, eps=0.0, backend="reference")

    def run() -> torch.Tensor:
        return experts_forward(ensure_ops(), x, w13[mine], s13[mine], w2[mine], s2[mine], wts,
                               ids, expert_map=emap, **kw)  # fmt: skip

    eager = run()
    monkeypatch.setattr(expert_shards, "capturing", lambda t: True)
    captured = run()
    local = (emap[ids] >= 0).float()
    full = experts_forward(ensure_ops(), x, w13, s13, w2, s2, wts * local, ids, **kw)

    def bits(t: torch.Tensor) -> torch.Tensor:  # a route weighted 0 may leave -0.0: same value
        return (t + 0.0).view(torch.int16)

    assert torch.equal(bits(eager), bits(full))
    assert torch.equal(bits(captured), bits(full))
    elsewhere, own = rank, 1 - rank  # token 0 is all on rank 1, token 1 all on rank 0
    assert bool((captured[elsewhere] == 0).all()) and bool((eager[elsewhere] == 0).all())
    assert bool((captured[own] != 0).any())


def test_local_expert_0_is_held_here():
    """Global expert 4 is local expert 0 on rank 1 (a falsy id, not 'held elsewhere')."""
    layer = _StandinExperts(ep=(2, 1), experts=4)
    model = _model(layer)
    assert [local_expert(layer, e) for e in range(E)] == [None] * 4 + [0, 1, 2, 3]
    layer.w13_weight.data.view(torch.uint8)[0] = 9
    name = "model.layers.1.mlp.experts.4.gate_proj.weight"
    vname, p, start, rows = resolve_expert_tensor(model, name)
    assert vname == "model.layers.1.mlp.experts.w13_weight" and (start, rows) == (0, INTER)
    assert bool((p.view(torch.uint8) == 9).all())
    up = name.replace("gate_proj", "up_proj")
    _, p, start, rows = resolve_expert_tensor(model, up)  # up rows follow the gate's in w13
    layer.w13_weight.data.view(torch.uint8)[0, INTER:] = 5
    assert (start, rows) == (INTER, INTER) and bool((p[start:].view(torch.uint8) == 5).all())
    _, p, start, rows = resolve_expert_tensor(model, up + "_scale_inv")
    assert (start, rows) == (INTER // 128, INTER // 128) and tuple(p.shape) == (4, H // 128)
    t = torch.ones(INTER, H)
    assert rank_expected(model, name, t) is t
    flat, token, _ = local_routes(torch.tensor([[4, 1]]), torch.ones(1, 2), layer._expert_map)
    assert flat.tolist() == [0] and token.tolist() == [0]


def test_padded_intermediate_size_per_rank_is_refused_by_its_unpadded_size():
    """vLLM pads the per-rank intermediate size (``intermediate_size_per_partition``) up for
    its kernels and keeps the real one (``..._unpadded``): 192 padded to 256 on each of 2 TP
    ranks is refused as 192 (of 384), though 256 is 128-aligned; tp=1 and expert parallel
    hold whole experts and are never refused for it."""
    padded = _StandinExperts(tp=(2, 0), i_part=256)
    padded.moe_config.intermediate_size_per_partition_unpadded = 192
    (msg,) = shard_problems(padded)
    assert msg.startswith("tensor parallel 2 gives each rank 192 of the expert intermediate size")
    assert "384, not a multiple of 128" in msg and "tensor_parallel_size dividing 3" in msg
    exact = _StandinExperts(tp=(2, 0), i_part=256)
    exact.moe_config.intermediate_size_per_partition_unpadded = None  # older vLLM: not set
    assert shard_problems(exact) == []
    whole = _StandinExperts(i_part=256)  # tp=1: the unaligned real size is the model's own
    whole.moe_config.intermediate_size_per_partition_unpadded = 192
    assert shard_problems(whole) == []
    assert shard_problems(_StandinExperts(ep=(2, 0), experts=4, i_part=192)) == []
    (msg,) = shard_problems(_StandinExperts(tp=(2, 1), i_part=64))
    assert "gives each rank 64" in msg and "128, not a multiple of 128" in msg


def test_fused_dtype_covers_every_expert_id_and_none_beyond():
    """An expert id names a fused parameter up to E-1 whether this rank holds it or not; id E
    is not an expert of the layer."""
    for layer in (_StandinExperts(), _StandinExperts(ep=(2, 0), experts=4)):
        model = _model(layer)

        def dtype(e: int, proj: str = "down_proj", leaf: str = "weight", model=model):
            return fused_dtype(model, f"model.layers.1.mlp.experts.{e}.{proj}.{leaf}")

        assert [dtype(e) for e in range(E)] == [torch.float8_e4m3fn] * E
        assert dtype(E - 1, "up_proj", "weight_scale_inv") == torch.float32
        assert dtype(E) is None
