"""MoE blocks on the local backend (issue 27), on real HF Qwen3-MoE and Mixtral models.

HF's own forward is what `MoeBlock` must compute (routing, renormalisation, combine); swaps
share the parameter objects and are undone by `restore`; experts are FP8 where the dense filters
say, the router never; the rollout's expert bytes are the trainer's quantization; rollout and
trainer logprobs are equal bit for bit under jetrl; a planted router divergence shows the
metric and what replay does. Whole runs: test_local_moe_runs.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import tiny_hf_config, tiny_hf_model

from nemo_jetrl.backends.local.model import build_model
from nemo_jetrl.backends.local.moe import MoeBlock, convert_moe_blocks, moe_blocks
from nemo_jetrl.backends.local.precision import (
    make_rollout_model,
    make_trainer_model,
    side_fp8_config,
)
from nemo_jetrl.backends.local.refit import RefitRefused, export_weights, refit
from nemo_jetrl.backends.local.rollout import generate
from nemo_jetrl.backends.local.routing import ROUTING_MISMATCH, RoutingController
from nemo_jetrl.backends.local.trainer import sequence_logprobs
from nemo_jetrl.fp8 import Fp8BlockLinear, Fp8InferenceLinear, fp8_bits
from nemo_jetrl.fp8.experts import quantize_expert_weights
from nemo_jetrl.invariant import make_batch_invariant
from nemo_jetrl.invariant import moe as imoe
from nemo_jetrl.recipe import Recipe


def _moe_config(kind: str, **fields):
    """Tiny 128-aligned MoE configs: Qwen3-MoE with a dense first layer, or Mixtral."""
    base = dict(
        vocab_size=32, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=128, num_experts_per_tok=2,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if kind == "qwen3_moe":
        base |= dict(
            intermediate_size=256, moe_intermediate_size=128, num_experts=4,
            mlp_only_layers=[0], norm_topk_prob=True,
        )  # fmt: skip
    else:
        base |= dict(intermediate_size=128, num_local_experts=4)
    return tiny_hf_config(kind, **(base | fields))


def _pair(kind: str, recipe: str, **fields):
    """(rollout, trainer) models of one config under ``recipe``, batch-invariant, refit once."""
    cfg = _moe_config(kind, **fields)
    tm = build_model(cfg, seed=1, dtype=torch.bfloat16)  # eager attention, as the backend runs
    rm = build_model(cfg, seed=1, dtype=torch.bfloat16)
    r = Recipe.preset(recipe)
    tplan, rplan = (
        make_trainer_model(tm, r, exact_gemm=True),
        make_rollout_model(rm, r, exact_gemm=True),
    )
    make_batch_invariant(tm)
    make_batch_invariant(rm)
    refit(rm, export_weights(tm))
    return rm, tm, tplan, rplan


# ---------------------------------------------------------------------------------- blocks


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_block_computes_hf_forward_and_swap_is_reversible(kind):
    model = tiny_hf_model(_moe_config(kind), seed=3)  # fp32: compare the math, not roundings
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(0))
    hf_blocks = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("MoeBlock")}
    assert len(hf_blocks) == (1 if kind == "qwen3_moe" else 2)  # mlp_only_layers=[0]: dense
    want = {n: m(x) for n, m in hf_blocks.items()}
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    handle = convert_moe_blocks(model, Recipe.preset("bf16").train, None)
    assert [type(b) for b in handle.blocks] == [MoeBlock] * len(hf_blocks)
    assert {n: p for n, p in model.named_parameters()} == params  # the same objects
    assert sorted(model.state_dict()) == sorted(keys)
    for name, block in zip(hf_blocks, handle.blocks, strict=True):
        torch.testing.assert_close(block(x), want[name], rtol=1e-5, atol=1e-6)
    handle.restore()
    assert not moe_blocks(model)
    assert all(model.get_submodule(n) is m for n, m in hf_blocks.items())


def test_batch_invariance_refuses_unswapped_hf_blocks_and_switches_swapped_ones():
    model = build_model(_moe_config("mixtral"), seed=0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp \(MixtralSparseMoeBlock\)"):
        make_batch_invariant(model)
    convert_moe_blocks(model, Recipe.preset("bf16").train, None)
    blocks = moe_blocks(model)
    assert not any(b.invariant or b.experts.invariant for b in blocks)
    handle = make_batch_invariant(model)
    assert all(b.invariant and b.experts.invariant for b in blocks)
    handle.restore()
    assert not any(b.invariant or b.experts.invariant for b in blocks)


def test_topk_ties_go_to_the_lower_expert_and_routing_is_batch_invariant():
    probs = torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.25, 0.25, 0.25, 0.25]])
    assert imoe.top_k(probs, 2).tolist() == [[1, 2], [0, 1]]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 256, generator=g).bfloat16()
    x = torch.randn(37, 256, generator=g).bfloat16()

    def route(rows):
        p = imoe.router_probs(imoe.router_logits(rows, w, invariant=True), invariant=True)
        idx = imoe.top_k(p, 2)
        return idx, imoe.slot_weights(p, idx, normalize=True, invariant=True)

    idx_all, w_all = route(x)
    for i in (0, 5, 36):
        idx_one, w_one = route(x[i : i + 1])
        assert torch.equal(idx_one[0], idx_all[i])
        assert torch.equal(w_one[0].view(torch.int32), w_all[i].view(torch.int32))


def test_experts_fp8_exactly_where_dense_linears_are_router_never():
    r = Recipe.preset("jetrl")
    side = r.train.with_(bf16_layer_kws=("down_proj",))
    model = tiny_hf_model(_moe_config("qwen3_moe"), seed=0, dtype=torch.bfloat16)
    handle = convert_moe_blocks(model, side, side_fp8_config(side))
    assert handle.fp8 == ["model.layers.1.mlp.experts.gate_up_proj"]
    assert "model.layers.1.mlp.experts.down_proj" in handle.kept  # as the dense down_proj
    # BF16 first/last layers: the experts of those layers stay BF16 too
    first = r.train.with_(bf16_first_layers=1)
    mix = tiny_hf_model(_moe_config("mixtral"), seed=0, dtype=torch.bfloat16)
    h1 = convert_moe_blocks(mix, first, side_fp8_config(first))
    assert h1.fp8 == [f"model.layers.1.mlp.experts.{w}" for w in ("gate_up_proj", "down_proj")]
    assert set(h1.kept) == {
        f"model.layers.0.mlp.experts.{w}" for w in ("gate_up_proj", "down_proj")
    }
    # dims that do not tile 128 keep experts BF16, reported
    small = tiny_hf_model(_moe_config("mixtral", intermediate_size=96), seed=0)
    h2 = convert_moe_blocks(small, r.train, side_fp8_config(r.train))
    assert h2.fp8 == [] and all("multiples of 128" in v for v in h2.kept.values())
    # rollout and trainer of jetrl: experts FP8 on both sides, the router a plain weight
    rm, tm, tplan, rplan = _pair("qwen3_moe", "jetrl")
    assert (
        tplan.moe.fp8
        == rplan.moe.fp8
        == [
            "model.layers.1.mlp.experts.gate_up_proj",
            "model.layers.1.mlp.experts.down_proj",
        ]
    )
    ex = [
        n for n, m in rm.named_modules() if isinstance(m, Fp8InferenceLinear) and ".experts." in n
    ]
    assert len(ex) == 8  # 4 experts x 2 projections, per expert like a dense rollout linear
    for m in (rm, tm):
        gate = m.get_submodule("model.layers.1.mlp.gate")
        assert not isinstance(gate, (Fp8BlockLinear, Fp8InferenceLinear))
        assert not any(isinstance(c, (Fp8BlockLinear, Fp8InferenceLinear)) for c in gate.modules())
    assert isinstance(tm.get_submodule("model.layers.0.mlp.down_proj"), Fp8BlockLinear)


def test_routing_mismatch_counts_slots_of_real_response_tokens_only():
    model = build_model(_moe_config("qwen3_moe"), seed=0, dtype=torch.bfloat16)
    convert_moe_blocks(model, Recipe.preset("bf16").train, None)
    ctl = RoutingController(model, model, replay=False)
    P, R = 3, 4  # positions P-1 .. P+R-2 produce the R response logprobs
    roll = torch.zeros(2, P + R - 1, 2, dtype=torch.int32)
    roll[..., 1] = 1
    own = torch.cat([roll, roll[:, :1]], dim=1).clone()  # the trainer sees one more position
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    own[1, P - 1 + 3, 0] = 3  # differs after row 1's <eos>: padding, not counted
    own[0, 0, :] = 2  # differs inside the prompt: not counted
    own[0, P + R - 1] = 3  # the last position: the rollout never computed it
    ctl.rollout_choices, ctl.train_choices = [roll], [own]
    assert ctl.metrics(P, mask) == {ROUTING_MISMATCH: 0.0}
    own[0, P - 1, :] = torch.tensor([1, 0], dtype=torch.int32)  # same set, other order: same
    assert ctl.metrics(P, mask) == {ROUTING_MISMATCH: 0.0}
    own[0, P, 1] = 2  # one slot of one real token (5 tokens x 2 slots)
    own[1, P, :] = 3  # both slots of another
    assert ctl.metrics(P, mask) == {ROUTING_MISMATCH: 3 / 10}


@pytest.mark.parametrize("recipe", ["jetrl", "fp8_rollout"])
def test_rollout_expert_bytes_are_the_trainers_quantization(recipe):
    rm, tm, _, _ = _pair("mixtral", recipe)
    for which in ("gate_up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.{which}"
        layers = rm.get_submodule(name)
        if recipe == "fp8_rollout":  # vLLM's own quantizer, emulated: off-policy by design
            assert {layer.quantizer for layer in layers} == {"vllm_native"}
            continue
        cfg = side_fp8_config(Recipe.preset(recipe).train, exact_gemm=True)
        q = quantize_expert_weights(tm.get_parameter(name).detach(), cfg)
        for e, layer in enumerate(layers):
            assert layer.quantizer == "jetrl"
            assert torch.equal(fp8_bits(layer.weight_fp8), fp8_bits(q.data[e].contiguous()))
            assert torch.equal(layer.weight_scale_inv, q.scale_inv[e])


def test_refit_with_a_bad_expert_is_refused_naming_it_and_loads_nothing():
    rm, tm, _, _ = _pair("qwen3_moe", "jetrl")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    before = [fp8_bits(m.weight_fp8).clone() for m in rm.get_submodule(name)]
    weights = dict(export_weights(tm))
    bad = weights[name].clone()
    bad[2, 5, 7] = float("nan")
    weights[name] = bad * 2  # every expert changes; expert 2 is not finite
    with pytest.raises(RefitRefused, match=rf"{name}\.2\.weight: 1 non-finite"):
        refit(rm, weights)
    after = [fp8_bits(m.weight_fp8) for m in rm.get_submodule(name)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    del weights[name]
    with pytest.raises(RefitRefused, match=rf"{name}\.0\.weight: missing"):
        refit(rm, weights)


@pytest.mark.parametrize(("kind", "recipe"), [("qwen3_moe", "jetrl"), ("mixtral", "jetrl")])
def test_rollout_and_trainer_logprobs_bitwise_and_replay_uses_rollout_experts(kind, recipe):
    rm, tm, _, _ = _pair(kind, recipe)
    prompt = torch.randint(3, 32, (4, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=7, temperature=1.0, eos_id=2, pad_id=0)
    ctl = RoutingController(rm, tm, replay=False)
    with ctl.rollout():
        rb = generate(rm, prompt, generator=torch.Generator().manual_seed(1), **kw)
    ids = torch.cat([prompt, rb.response_ids], 1)
    with ctl.training(record=True), torch.no_grad():
        prev = sequence_logprobs(tm, ids, 6, 1.0)
    m = rb.response_mask
    assert torch.equal(prev[m].view(torch.int32), rb.generation_logprobs[m].view(torch.int32))
    assert ctl.metrics(6, m) == {ROUTING_MISMATCH: 0.0}

    # plant a divergence: the rollout's router moves, the trainer's does not
    with torch.no_grad():
        for b in moe_blocks(rm):
            b.gate.weight.add_(torch.randn_like(b.gate.weight) * 0.05)
    for replay in (False, True):
        ctl = RoutingController(rm, tm, replay=replay)
        with ctl.rollout():
            rb = generate(rm, prompt, generator=torch.Generator().manual_seed(1), **kw)
        ids = torch.cat([prompt, rb.response_ids], 1)
        tm.train()
        with ctl.training(record=True):
            lp = sequence_logprobs(tm, ids, 6, 1.0)
        mism = ctl.metrics(6, rb.response_mask)[ROUTING_MISMATCH]
        assert 0.0 < mism <= 1.0, mism  # the trainer's own choices differ, replay or not
        for b, roll, own in zip(
            moe_blocks(tm), ctl.rollout_choices, ctl.train_choices, strict=True
        ):
            used = b.last_used[:, :-1].to(torch.int32)
            if replay:
                assert torch.equal(used, roll)  # every recorded position: the rollout's experts
                assert not torch.equal(own[:, :-1], roll)
            else:
                assert torch.equal(used, own[:, :-1])
        (lp * rb.response_mask).sum().backward()
        router = moe_blocks(tm)[-1].gate.weight
        assert router.grad is not None and float(router.grad.abs().sum()) > 0  # R3 keeps it
        tm.zero_grad(set_to_none=True)
        tm.eval()


def test_rollout_experts_run_grouped_and_a_refit_restacks_them(monkeypatch):
    """The jetrl rollout's FP8 experts never call their per-expert layers (the grouped path:
    tokens quantized once, fused SiLU*up quantization); a refit's new bytes are used at once
    (the stacked copy follows the layers' buffers), still bit-equal to the trainer."""
    rm, tm, _, _ = _pair("qwen3_moe", "jetrl")
    calls: list[str] = []
    real = Fp8InferenceLinear.forward

    def spy(self, x):
        if ".experts." in self.name:
            calls.append(self.name)
        return real(self, x)

    monkeypatch.setattr(Fp8InferenceLinear, "forward", spy)
    ids = torch.randint(3, 32, (3, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = sequence_logprobs(rm, ids, 4, 1.0)
        assert torch.equal(
            before.view(torch.int32), sequence_logprobs(tm, ids, 4, 1.0).view(torch.int32)
        )
        name = "model.layers.1.mlp.experts.down_proj"
        tm.get_parameter(name).mul_(-1.5)
        refit(rm, export_weights(tm))
        after = sequence_logprobs(rm, ids, 4, 1.0)
        want = sequence_logprobs(tm, ids, 4, 1.0)
    assert calls == [] and not torch.equal(after, before)
    assert torch.equal(after.view(torch.int32), want.view(torch.int32))
