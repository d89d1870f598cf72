"""A tiny Qwen3-MoE served by a real vLLM CPU engine under the Jet-RL patch (issue 28).

The model (hidden 256, 3 layers, layer 0 dense via ``mlp_only_layers``, layers 1-2 with 8
experts of width 128, top-2, head_dim 128) is written as a block-FP8 checkpoint by our own
trainer-side quantizer (``refit.quantize_state_dict``: every linear of the recipe in 128x128
blocks, routers ``mlp.gate`` and ``lm_head`` BF16, as real Qwen3 FP8 checkpoints list them in
``modules_to_not_convert``) and served by ``vllm.LLM`` under ``apply_patches``: dense linears run
our linear kernel and the routed experts our experts kernel (vllm_patch/experts.py), on any CPU
(vLLM's own CPU FP8 expert kernels need AMX). One FP8 engine and one BF16 control engine per
module (and one more for the rollout engine's test). vLLM 0.32, 0.25.1 (run by the NeMo-RL main
tier: the ``vllm_in_nemo_rl`` tests) and 0.20.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_engine_setup import (  # noqa: F401  (module fixtures: this module's FP8 engine)
    INTER,
    LAYERS,
    MOE_LAYERS,
    ROUTERS,
    USER_KWARGS,
    E,
    bf16_control_gap,
    fp8_reference,
    per_expert_state_dict,
    routed_experts_supported,
    served_fixture,
    settings_fixture,
    tiny_qwen3_moe,
    trainer_fixture,
    vllm_cpu_env_fixture,
    write_checkpoint,
)
from vllm_fixtures import (
    fp8_rounding_gap,
    generate_each,
    logprob_gap,
    moe_fp8_gap_bound,
)

pytestmark = pytest.mark.vllm
# The tests on the one FP8 engine (`served`): the NeMo-RL main tier runs them too, as vLLM 0.25.1
# has no vLLM tier of its own (scripts/test_nemo_rl.sh); the BF16 control's and the rollout
# engine's tests run in the vLLM tiers only.
ONE_ENGINE = pytest.mark.vllm_in_nemo_rl

MAX_TOKENS = 8
PROMPTS = ["Hello wor", "The cat s", "0123456"]


def experts_layer(i: int) -> str:
    """vLLM's module holding layer ``i``'s expert weights: 0.25 and 0.32 nest RoutedExperts in
    the MoE runner, 0.20's FusedMoE holds them itself."""
    import vllm

    from nemo_jetrl.vllm_patch.compat import release

    nested = release(vllm.__version__) >= (0, 25, 0)
    return f"model.layers.{i}.mlp.experts" + (".routed_experts" if nested else "")


def _generate(llm):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    return generate_each(llm, PROMPTS, sp)  # same batches every call


# Its own engine (issue 40): vLLM unpatched, BF16 experts (the control).
@pytest.fixture(scope="module")
def bf16_control(tmp_path_factory, trainer):
    """Control: the BF16 checkpoint on vLLM (BF16 experts) vs the BF16 HF forward."""
    return bf16_control_gap(trainer, tmp_path_factory.mktemp("moe_bf16"), _generate)


@ONE_ENGINE
def test_patch_installs_and_reverts_our_moe_method(settings):
    """apply_patches makes Fp8Config build our experts method (idempotent), revert restores
    vLLM's own class object; other settings while applied are refused."""
    import vllm.model_executor.layers.quantization.fp8 as fp8_mod

    from nemo_jetrl.vllm_patch import apply_patches
    from nemo_jetrl.vllm_patch.experts import install_moe_method

    original = fp8_mod.Fp8MoEMethod
    assert not getattr(original, "_nemo_jetrl_moe_method", False)
    with apply_patches(settings):
        ours = fp8_mod.Fp8MoEMethod
        assert ours is not original and issubclass(ours, original)
        assert ours.jetrl_settings_json == settings.to_json()
        assert install_moe_method(settings) is ours  # idempotent
        other = dataclasses.replace(settings, pow2_activation_scales=False)
        with pytest.raises(RuntimeError, match="different settings"):
            install_moe_method(other)
    assert fp8_mod.Fp8MoEMethod is original


@ONE_ENGINE
def test_versions_covered_and_own_routing_where_vllm_cannot_route_on_cpu():
    """The experts kernel covers the installed vLLM (and exactly the engine-tested releases);
    our method routes itself exactly where vLLM's router cannot run on a CPU (0.20, 0.25.1: no
    ``topk_softmax`` op and no CPU router), so the version rule is checked against the build."""
    import vllm

    from nemo_jetrl.vllm_patch import moe_versions

    assert moe_versions.moe_supported(vllm.__version__)
    ok = {v: moe_versions.moe_supported(v) for v in ("0.20.0", "0.25.1", "0.32.0", "0.32.9")}
    no = {v: moe_versions.moe_supported(v) for v in ("0.20.1", "0.25.0", "0.25.2", "0.33.0")}
    assert all(ok.values()) and not any(no.values()), (ok, no)
    assert moe_versions.own_routing(vllm.__version__) == (not moe_versions.vllm_routes_on_cpu())


@ONE_ENGINE
def test_experts_run_our_kernel_and_no_vllm_fp8_expert_kernel(served, settings):
    from nemo_jetrl.vllm_patch.guard import kernel_problems

    llm, _, _ = served
    _generate(llm)
    report = llm.collective_rpc("jetrl_kernel_report")[0]
    layers = report["layers"]
    moe = {n: v for n, v in layers.items() if v.get("moe")}
    assert sorted(moe) == [experts_layer(i) for i in MOE_LAYERS]
    for info in moe.values():
        # our method, no vLLM experts kernel built (it would be named " with <class>")
        assert info["kernel"] == "JetRLFp8MoEMethod" and info["ours"], info
        assert info["calls"] > 0  # it is what ran during generate
    dense = {n for n, v in layers.items() if not v.get("moe")}
    assert len(dense) == 3 * 2 + 2  # qkv, o in 3 layers + layer 0's gate_up, down
    assert not any(n.endswith(".mlp.gate") for n in layers)  # routers BF16
    assert {v["kernel"] for n, v in layers.items() if n in dense} == {"JetRLFp8BlockLinearKernel"}
    assert kernel_problems([report], settings, "JetRLFp8BlockLinearKernel") == []


def test_logprobs_match_the_fp8_reference_forward(served, trainer, bf16_control):
    """The engine's logprobs agree with our in-process FP8 MoE forward as closely as the BF16
    engine agrees with the BF16 forward allows (control measured here, on this CPU)."""
    llm, _, _ = served
    outs = _generate(llm)
    ref = fp8_reference(trainer)
    gap = logprob_gap(outs, ref)
    gap_bf16_ref = logprob_gap(outs, trainer)
    rounding = fp8_rounding_gap(outs, ref)
    bound = moe_fp8_gap_bound(bf16_control, rounding)
    print(
        f"moe logprob gap: fp8 engine vs fp8 ref {gap:.4f}, vs bf16 ref {gap_bf16_ref:.4f}, "
        f"bound {bound:.4f} (controls: bf16 engine vs bf16 ref {bf16_control:.4f}, fp8 ref "
        f"bf16 vs fp32 {rounding:.4f})"
    )
    assert gap <= bound, (gap, bf16_control, rounding)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)


def _lps(o) -> list[float]:
    c = o.outputs[0]
    return [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)]


def _expert_names(sd):
    return sorted(n for n in sd if ".mlp.experts." in n)


@ONE_ENGINE
def test_refit_loads_new_experts_with_parity_over_every_expert_tensor(served, settings):
    """A refit to another model's weights lands every expert tensor as the trainer quantized
    it (parity bit for bit over all 2 layers x 8 experts x 3 projections x weight/scale), the
    engine then follows the new weights, and a refit back restores the first logprobs exactly."""
    from nemo_jetrl.vllm_patch.refit import check_parity, quantize_state_dict, refit

    llm, _, sd0 = served
    before = _generate(llm)
    new = tiny_qwen3_moe(1)
    report = refit(llm, per_expert_state_dict(new), settings)
    assert report.parity is not None and report.parity.differing == ()
    qsd = quantize_state_dict(per_expert_state_dict(new), settings, dtype=torch.bfloat16)
    experts = [n for n in qsd.fp8_names() if ".mlp.experts." in n]
    assert len(experts) == len(MOE_LAYERS) * E * 3 * 2
    assert report.parity.fp8 == len(qsd.fp8_names())
    assert check_parity(llm, qsd).differing == ()
    after = _generate(llm)
    gap_new = logprob_gap(after, fp8_reference(new))
    assert [o.outputs[0].token_ids for o in after] != [o.outputs[0].token_ids for o in before] or (
        logprob_gap(after, fp8_reference(tiny_qwen3_moe(0))) > gap_new
    )
    # back to the checkpoint's weights: exactly the first engine's outputs again
    refit(llm, per_expert_state_dict(tiny_qwen3_moe(0)), settings)
    again = _generate(llm)
    for a, b in zip(again, before, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert _lps(a) == _lps(b)
    assert _expert_names(sd0)


@ONE_ENGINE
def test_parity_names_a_corrupted_expert_and_rollback_restores_it(served, settings):
    """One flipped FP8 byte in one expert is named by parity; the worker's snapshot/restore
    (what a failed refit's rollback runs) puts every expert tensor back bit for bit."""
    from nemo_jetrl.vllm_patch.refit import ParityError, check_parity, quantize_state_dict

    llm, _, _ = served
    qsd = quantize_state_dict(per_expert_state_dict(tiny_qwen3_moe(0)), settings)
    llm.collective_rpc("jetrl_snapshot")
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    bad = dict(qsd.tensors)
    flipped = bad[name].clone().view(torch.uint8)
    flipped[3, 7] ^= 0x01
    bad[name] = flipped.view(torch.float8_e4m3fn)
    from nemo_jetrl.vllm_patch.worker_ext import pack

    llm.collective_rpc("jetrl_load_weights", args=(pack({name: bad[name]}),))
    with pytest.raises(ParityError, match=name.replace(".", r"\.")):
        check_parity(llm, qsd)
    llm.collective_rpc("jetrl_restore")
    assert check_parity(llm, qsd).differing == ()


@ONE_ENGINE
def test_refused_refits_leave_every_expert_bit_identical(served, settings):
    """A refit refused before sending (one non-finite expert weight among otherwise valid new
    weights) changes nothing; a refit that failed in the engine after every tensor was written
    (parity finds a flipped expert byte inside ``engine_rollback``, as ``refit`` runs it) is
    rolled back: parity against the previous weights passes over every expert tensor again."""
    from nemo_jetrl.vllm_patch.refit import (
        ParityError,
        RefitError,
        check_parity,
        quantize_state_dict,
        refit,
    )
    from nemo_jetrl.vllm_patch.rollback import engine_rollback
    from nemo_jetrl.vllm_patch.worker_ext import pack

    llm, _, _ = served
    qsd0 = quantize_state_dict(per_expert_state_dict(tiny_qwen3_moe(0)), settings)
    assert check_parity(llm, qsd0).differing == ()  # what the engine holds now
    bad_name = "model.layers.2.mlp.experts.3.up_proj.weight"
    bad = per_expert_state_dict(tiny_qwen3_moe(4))
    bad[bad_name][0, 0] = float("nan")
    with pytest.raises(RefitError, match=bad_name.replace(".", r"\.")):
        refit(llm, bad, settings)
    assert check_parity(llm, qsd0).differing == ()
    new = quantize_state_dict(per_expert_state_dict(tiny_qwen3_moe(4)), settings)
    flipped = dict(new.tensors)
    name = "model.layers.1.mlp.experts.6.gate_proj.weight"
    raw = flipped[name].clone().view(torch.uint8)
    raw[1, 2] ^= 0x01
    flipped[name] = raw.view(torch.float8_e4m3fn)
    want = dataclasses.replace(new, tensors=flipped)
    named = r"experts\.6\.gate_proj\.weight[\s\S]*rolled back"
    with pytest.raises(ParityError, match=named), engine_rollback(llm):
        llm.collective_rpc("jetrl_load_weights", args=(pack(new.tensors),))
        check_parity(llm, want)  # names the flipped expert: the rollback runs
    back = check_parity(llm, qsd0)  # every expert weight and scale as before the refit
    experts = [n for n in qsd0.fp8_names() if ".mlp.experts." in n]
    assert back.differing == () and back.fp8 == len(qsd0.fp8_names())
    assert len(experts) == len(MOE_LAYERS) * E * 3 * 2


def _expert_weights(sd, layer: int, e: int):
    from nemo_jetrl.fp8.quantize import BlockQuantized

    def q(*projs):
        base = f"model.layers.{layer}.mlp.experts.{e}"
        data = torch.cat([sd[f"{base}.{p}.weight"] for p in projs])
        scale = torch.cat([sd[f"{base}.{p}.weight_scale_inv"] for p in projs])
        return BlockQuantized(data, scale, (128, 128), "e4m3", True)

    return q("gate_proj", "up_proj"), q("down_proj")


@ONE_ENGINE
def test_engine_experts_bit_exact_to_the_dense_path(served, settings):
    """What vLLM's MoE layers computed during generate, recomputed from their captured inputs
    with the checkpoint's FP8 experts through the dense path (nemo_jetrl.fp8 quantizer, the
    same GEMM backend), is bit for bit the engine's output; the router's choices are compared
    with a BF16 torch router on the same inputs."""
    from nemo_jetrl.fp8 import quantize_blockwise
    from nemo_jetrl.fp8.gemm_backends import run_gemm
    from nemo_jetrl.vllm_patch.worker_ext import unpack

    llm, _, sd = served
    llm.collective_rpc("jetrl_capture", args=(64,))
    try:
        _generate(llm)
        blob = unpack(llm.collective_rpc("jetrl_captured")[0])
    finally:
        llm.collective_rpc("jetrl_capture", args=(0,))
    report = llm.collective_rpc("jetrl_kernel_report")[0]["layers"]

    def dense(x, qw, backend):
        qx = quantize_blockwise(x, (1, 128), pow2_scales=settings.pow2_activation_scales)
        return run_gemm(backend, qx, qw, x.dtype)

    calls = same_route = routed = 0
    for i in MOE_LAYERS:
        name = experts_layer(i)
        backend = report[name]["gemm_backend"]
        gate_w = per_expert_state_dict(tiny_qwen3_moe(0))[f"model.layers.{i}.mlp.gate.weight"]
        n_calls = len({k.split("|")[1] for k in blob if k.startswith(name + "|")})
        for c in range(n_calls):
            x, ids, w, out = (blob[f"{name}|{c}|{k}"] for k in ("x", "ids", "w", "out"))
            want = torch.zeros(out.shape, dtype=torch.float32)
            for e in range(E):
                tok, pos = torch.where(ids == e)
                if tok.numel() == 0:
                    continue
                q13, q2 = _expert_weights(sd, i, e)
                gate, up = dense(x[tok], q13, backend).split(INTER, dim=-1)
                y = dense(torch.nn.functional.silu(gate) * up, q2, backend)
                want.index_add_(0, tok, y.float() * w[tok, pos, None].float())
            assert torch.equal(out, want.to(out.dtype)), (name, c)
            probs = torch.softmax((x @ gate_w.t()).float(), dim=-1)
            ref_ids = probs.topk(2, dim=-1).indices
            same_route += int((ref_ids.sort(-1).values == ids.long().sort(-1).values).all(-1).sum())
            routed += x.shape[0]
            calls += 1
    assert calls >= 2 * MAX_TOKENS  # prefill + every decode step, in both MoE layers
    print(f"moe routing: {same_route}/{routed} tokens with the BF16 torch router's experts")
    assert same_route >= 0.9 * routed


@ONE_ENGINE
def test_routed_experts_returned_for_routing_replay(served, trainer, tmp_path):
    """vLLM 0.20 and 0.25.1: with enable_return_routed_experts an output carries, per token, the
    experts our kernel computed it with ([tokens - 1, layers, top_k]; the dense layer 0 all
    zeros): exactly the ids captured inside our experts method, call by call (our monolithic
    method feeds vLLM's capture: 0.20 on the layer's router, 0.25.1 on the MoE runner's). vLLM
    0.32's CPU build refuses the option (Model Runner V2 needs Triton): no source there."""
    from vllm import SamplingParams

    from nemo_jetrl.vllm_patch.experts import routed_experts
    from nemo_jetrl.vllm_patch.worker_ext import unpack

    if not routed_experts_supported():
        from vllm import LLM

        # a start of its own: the engine option is what is refused (before loading)
        write_checkpoint(trainer, tmp_path)  # BF16: the option is refused before loading
        with pytest.raises(Exception, match="Model Runner V2"):
            LLM(model=str(tmp_path), enable_return_routed_experts=True, **USER_KWARGS)
        return
    llm, _, _ = served
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm.collective_rpc("jetrl_capture", args=(64,))
    try:
        (out,) = llm.generate(["Zebras q"], sp, use_tqdm=False)  # one request: calls in order
        blob = unpack(llm.collective_rpc("jetrl_captured")[0])
    finally:
        llm.collective_rpc("jetrl_capture", args=(0,))
    got = torch.as_tensor(routed_experts(out))
    n = len(out.prompt_token_ids) + MAX_TOKENS - 1
    assert tuple(got.shape) == (n, LAYERS, 2)
    assert not got[:, 0].any()  # layer 0 is dense
    for i in MOE_LAYERS:
        name = experts_layer(i)
        calls = sorted({int(k.split("|")[1]) for k in blob if k.startswith(name + "|")})
        ours = torch.cat([blob[f"{name}|{c}|ids"] for c in calls]).long()
        assert tuple(ours.shape) == (n, 2)
        assert torch.equal(got[:, i].long(), ours), i


def test_rollout_engine_serves_a_bf16_moe_checkpoint(tmp_path_factory, trainer, bf16_control):
    """VllmRolloutEngine (jetrl recipe, a BF16 HF MoE checkpoint: dummy load + first refit)
    keeps the routers BF16 by itself (read from config.json), runs our kernels, refits every
    expert tensor with parity, and agrees with the FP8 reference within the control's bound."""
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch.engine import VllmRolloutEngine

    # Fresh engine: what is checked is VllmRolloutEngine's own start (dummy load, first refit).
    d = tmp_path_factory.mktemp("moe_bf16_ckpt")
    write_checkpoint(trainer, d)
    with VllmRolloutEngine(d, Recipe.preset("jetrl"), engine_kwargs=USER_KWARGS) as eng:
        assert set(ROUTERS) <= set(eng.settings.modules_to_not_convert)
        layers = eng.kernel_report["layers"]
        assert sorted(n for n, v in layers.items() if v.get("moe")) == [
            experts_layer(i) for i in MOE_LAYERS
        ]
        assert all(v["ours"] for v in layers.values())
        parity = eng.last_refit.parity
        assert parity.differing == () and parity.fp8 == 2 * (
            4 * LAYERS + 3 + len(MOE_LAYERS) * E * 3
        )
        outs, ref = _generate(eng.llm), fp8_reference(trainer)
        gap, rounding = logprob_gap(outs, ref), fp8_rounding_gap(outs, ref)
        print(f"moe rollout engine: fp8 gap {gap:.4f}, controls {bf16_control:.4f} {rounding:.4f}")
        assert gap <= moe_fp8_gap_bound(bf16_control, rounding), (gap, bf16_control, rounding)
