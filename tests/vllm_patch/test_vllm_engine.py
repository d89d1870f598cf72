"""The vLLM patch against a real engine (vLLM 0.32 or 0.20 CPU build; scripts/test_vllm.sh).

One small Llama built from a config (hidden 256, 2 layers, head_dim 128: every linear is a
multiple of 128) is saved with a character tokenizer to a temporary directory and served by
``vllm.LLM`` with the patch applied. The engine runs with vLLM's default process layout (engine
core and worker in their own processes), so everything below also shows that the patch reached
those processes through the plugin entry point.
"""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch
from hf_models import char_tokenizer, save_tiny_llama, tiny_llama_128
from vllm_fixtures import (
    FP8_GAP_FLOOR,
    FP8_GAP_PER_BF16_GAP,
    bf16_recipe_gap,
    fp8_gap_bound,
    generate_each,
    hf_logprobs,
    logprob_gap,
    vllm_cpu_env,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_env():
    # the module's engine in its own processes: tests below start and shut down another engine
    # in this process while it lives (vllm_fixtures.IN_PROCESS)
    with vllm_cpu_env(in_process=False):
        yield


MAX_TOKENS = 6
PROMPTS = ["Hello wor", "The cat s"]
USER_KWARGS = dict(dtype="bfloat16", max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_llama(d)
    return d


@pytest.fixture(scope="module")
def recipe():
    from nemo_jetrl.recipe import Recipe

    return Recipe.preset("jetrl")


@pytest.fixture(scope="module")
def rollout(model_dir, recipe):
    """A patched engine (VllmRolloutEngine: patch + engine kwargs + first refit)."""
    from nemo_jetrl.vllm_patch.engine import VllmRolloutEngine

    eng = VllmRolloutEngine(model_dir, recipe, engine_kwargs=USER_KWARGS)
    yield eng
    eng.close()
    gc.collect()


@pytest.fixture
def engine(rollout):
    """(llm, patch handle) of the module's engine."""
    return rollout.llm, rollout.patch


def _generate(llm, logprobs=0):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=logprobs, ignore_eos=True)
    return generate_each(llm, PROMPTS, sp)  # same batches every call


def _token_logprobs(out):
    return [
        [
            lp[tid].logprob
            for tid, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)
        ]
        for o in out
    ]


def test_every_fp8_linear_runs_our_kernel_in_the_worker(engine):
    llm, _ = engine
    kernels = llm.collective_rpc("jetrl_kernels")[0]
    fp8 = {n: k for n, k in kernels.items() if n.startswith("model.layers.")}
    assert len(fp8) == 8  # 2 layers x (qkv, o, gate_up, down)
    assert set(fp8.values()) == {"JetRLFp8BlockLinearKernel"}
    assert kernels["lm_head"] == "UnquantizedEmbeddingMethod"  # kept BF16


def test_rollout_engine_generate_api(rollout):
    tok = char_tokenizer()
    assert rollout.last_refit is not None and rollout.last_refit.parity.differing == ()
    prompts = [tok.encode(p) for p in PROMPTS]
    gens = rollout.generate(prompts, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert [g.prompt_token_ids for g in gens] == [tuple(p) for p in prompts]
    for g in gens:
        assert len(g.token_ids) == len(g.logprobs) == MAX_TOKENS
        assert all(math.isfinite(v) and v <= 0.0 for v in g.logprobs)
        assert tok.decode(list(g.token_ids)) == g.text
    # Sampling at temperature 1 with a seed is reproducible and returns the sampled token's logprob
    # (one prompt per call: the same batches each time, see vllm_fixtures.generate_each)
    a = [g for p in prompts for g in rollout.generate([p], max_tokens=4, temperature=1.0, seed=7)]
    b = [g for p in prompts for g in rollout.generate([p], max_tokens=4, temperature=1.0, seed=7)]
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]


def test_generation_with_per_token_logprobs_matches_fp8_trainer(engine, model_dir, recipe):
    """Each generated token carries a logprob, and it agrees with the trainer's FP8 forward as
    closely as the BF16 recipe's engine agrees with the BF16 trainer allows (control measured
    here, on this CPU: vllm_fixtures.fp8_gap_bound)."""
    from nemo_jetrl.fp8.config import Fp8LinearConfig
    from nemo_jetrl.fp8.convert import convert_to_fp8_training

    llm, _ = engine
    out = _generate(llm)
    lps = _token_logprobs(out)
    assert all(len(t) == MAX_TOKENS for t in lps)
    assert all(math.isfinite(v) and v <= 0.0 for t in lps for v in t)
    tok = char_tokenizer()
    assert all(tok.decode(o.outputs[0].token_ids) == o.outputs[0].text for o in out)

    # Trainer side: the same checkpoint under nemo_jetrl.fp8's FP8 linears (same quantizer; the
    # attention/norm/GEMM kernels differ, so logprobs agree to a tolerance), and in plain BF16.
    fp8_trainer = tiny_llama_128(0)
    convert_to_fp8_training(
        fp8_trainer, Fp8LinearConfig(pow2_scales=True), module_filter_fn=lambda m, n: n != "lm_head"
    )
    bf16_trainer = tiny_llama_128(0)
    diff_fp8, diff_bf16 = logprob_gap(out, fp8_trainer), logprob_gap(out, bf16_trainer)
    # Control: the BF16 recipe through the same kind of engine against the BF16 trainer.
    control = bf16_recipe_gap(model_dir, USER_KWARGS, _generate, bf16_trainer)
    bound = fp8_gap_bound(control)
    print(f"engine vs FP8 trainer {diff_fp8:.4f} nats; BF16 recipe control {control:.4f}")
    assert diff_fp8 < bound, (
        f"engine vs FP8 trainer logprobs differ by {diff_fp8:.4f} nats, more than {bound:.4f} "
        f"= {FP8_GAP_PER_BF16_GAP} x the BF16 recipe's engine-vs-trainer gap {control:.4f} "
        f"+ {FP8_GAP_FLOOR}"
    )
    # And the FP8 trainer is clearly closer than the BF16 one (measured: ~0.12-0.27 against
    # ~0.23-0.62 nats, the FP8 quantization error itself), i.e. the engine is on-policy.
    assert diff_fp8 < 0.6 * diff_bf16, (
        f"engine vs FP8 trainer {diff_fp8:.4f} nats is not clearly below engine vs BF16 trainer "
        f"{diff_bf16:.4f}"
    )


# The HF side of every engine-vs-trainer comparison (kept under this name for other modules).
_hf_logprobs = hf_logprobs


def test_two_refits_change_outputs_and_pass_parity(engine, recipe):
    from nemo_jetrl.vllm_patch.refit import ParityError, check_parity, quantize_state_dict, refit

    llm, _ = engine
    results = []
    for seed in (1, 2):
        sd = tiny_llama_128(seed).state_dict()
        report = refit(llm, sd, recipe)
        assert report.parity is not None and report.parity.fp8 == 2 * 14
        assert report.parity.compared == 2 * 14 + 7  # + embed, 4 norms, final norm, lm_head
        assert report.parity.through_kernel == 2  # embed_tokens and lm_head (vLLM GEMM path)
        assert report.parity.differing == ()
        results.append(_token_logprobs(_generate(llm)))
    assert results[0] != results[1], "different weights must change the outputs"

    # The parity check is not vacuous: against the other refit's quantization it names layers.
    other = quantize_state_dict(tiny_llama_128(1).state_dict(), recipe)
    with pytest.raises(ParityError) as ei:
        check_parity(llm, other)
    msg = str(ei.value)
    assert "model.layers.0.self_attn.q_proj.weight (" in msg
    assert "model.layers.1.mlp.down_proj.weight (" in msg
    # BF16 tensors too: lm_head both as a parameter and through the GEMM vLLM runs it with.
    assert "lm_head.weight (" in msg and "lm_head.weight (through the layer's GEMM:" in msg
    assert "model.embed_tokens.weight (" in msg and "model.norm.weight" not in msg
    # (pow2 scales of two random inits of the same distribution coincide, so scales may match)


def test_refit_keeps_parameter_identity(engine, recipe):
    llm, _ = engine
    sd = tiny_llama_128(3).state_dict()
    from nemo_jetrl.vllm_patch.refit import pack, quantize_state_dict

    qsd = quantize_state_dict(sd, recipe)
    result = llm.collective_rpc("jetrl_load_weights", args=(pack(qsd.tensors),))[0]
    assert result["moved"] == []
    assert "model.layers.0.self_attn.qkv_proj.weight_scale_inv" in result["loaded"]


def test_activations_entering_the_gemm_are_nemo_jetrl_fp8_bits(engine):
    from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise
    from nemo_jetrl.vllm_patch.refit import unpack

    llm, _ = engine
    assert llm.collective_rpc("jetrl_capture", args=(4,))[0] == 8
    try:
        _generate(llm)
        blob = unpack(llm.collective_rpc("jetrl_captured")[0])
    finally:
        llm.collective_rpc("jetrl_capture", args=(0,))
    layers = {k.split("|")[0] for k in blob}
    assert len(layers) == 8, layers
    checked = 0
    for key in [k for k in blob if k.endswith("|x")]:
        base = key[:-2]
        x, q, s = blob[key], blob[base + "|q"], blob[base + "|s"]
        assert x.dtype == torch.bfloat16 and q.dtype == torch.float8_e4m3fn
        ref = quantize_blockwise(x, (1, 128), pow2_scales=True)
        assert torch.equal(fp8_bits(q), fp8_bits(ref.data)), base
        assert torch.equal(s, ref.scale_inv), base
        checked += x.shape[0]
    assert checked > 0


def test_kv_scales_reach_the_attention_layers_and_bad_ones_are_refused(engine):
    from nemo_jetrl.vllm_patch.refit import RefitError, kv_scales, set_kv_scales

    llm, _ = engine
    good = {0: {"q": 0.5, "k": 0.125, "v": 0.25}, 1: {"q": 0.75, "k": 0.375, "v": 0.0625}}
    assert set_kv_scales(llm, good) == (
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
    )
    used = kv_scales(llm)
    for i, s in good.items():
        got = used[f"model.layers.{i}.self_attn.attn"]
        for k in "qkv":
            # what Attention.forward hands the backend (host float) and the device tensor
            assert got[k] == s[k] and got[f"{k}_tensor"] == s[k]
    with pytest.raises(RefitError, match="v_scale=nan"):
        set_kv_scales(
            llm, {0: {"q": 1.0, "k": 1.0, "v": float("nan")}, 1: {"q": 1.0, "k": 1.0, "v": 1.0}}
        )
    with pytest.raises(RefitError, match="unknown attention layers"):
        set_kv_scales(llm, {"model.layers.9.self_attn.attn": {"q": 1.0, "k": 1.0, "v": 1.0}})
    assert kv_scales(llm) == used, "refused scales must leave the previous ones in place"


def _engine_state(llm, recipe) -> dict[str, torch.Tensor]:
    """Every tensor a refit writes (read back from the worker, GEMM views included) as raw
    bytes, plus each attention layer's q/k/v scales."""
    from nemo_jetrl.vllm_patch.refit import kv_scales, quantize_state_dict, unpack

    names = list(quantize_state_dict(tiny_llama_128(0).state_dict(), recipe).tensors)
    blob = unpack(llm.collective_rpc("jetrl_read_back", args=(names, True))[0])
    state = {n: t.contiguous().view(torch.uint8) for n, t in blob.items()}
    for layer, per in kv_scales(llm).items():
        for k, v in per.items():
            state[f"{layer}|{k}"] = torch.tensor([float(v)], dtype=torch.float64).view(torch.uint8)
    return state


def test_refused_refits_leave_the_engine_bit_identical(engine, recipe):
    """Item 4 of issue 17: every refusal happens before the first tensor is sent. Each bad
    refit carries otherwise valid new weights (a different seed), so a partial load would
    show in the read-back."""
    from nemo_jetrl.kvcache.scales import KVScales
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch.refit import RefitError, refit

    llm, _ = engine
    kv_recipe = Recipe.preset("jetrl_kv")  # same FP8 weights; an FP8 KV cache takes scales
    new = tiny_llama_128(5).state_dict()
    huge = dict(new)
    q = "model.layers.1.self_attn.q_proj.weight"
    huge[q] = new[q].clone()
    huge[q][0, 0] = torch.finfo(torch.bfloat16).max  # pow2 scale 2**120: 448 x 2**120 = inf
    good = {0: {"q": 0.5, "k": 0.25, "v": 0.125}, 1: {"q": 1.0, "k": 2.0, "v": 0.5}}
    cases = [
        ("unknown layer", new, {**good, 7: good[0]}, None, "unknown attention layers"),
        ("layer -1", new, {-1: good[0], 0: good[0]}, None, "layer key -1 must be a decoder"),
        ("bool scale", new, {0: {**good[0], "k": True}, 1: good[1]}, None, "got bool"),
        ("str scale", new, {0: {**good[0], "v": "0.5"}, 1: good[1]}, None, "got str"),
        ("0 in fp32", new, {0: {**good[0], "q": 1e-46}, 1: good[1]}, None, "it is 0.0 there"),
        ("stale", new, KVScales(good, calibrated_for=3), 4, "stale"),
        ("bf16-max weight", huge, None, None, "q_proj.weight: 1 block(s) dequantize past"),
    ]
    before = _engine_state(llm, recipe)
    for label, sd, kv, version, match in cases:
        with pytest.raises(RefitError) as ei:
            refit(llm, sd, kv_recipe, kv_scales=kv, weights_version=version)
        assert match in str(ei.value), (label, str(ei.value))
        after = _engine_state(llm, recipe)
        changed = [n for n in before if not torch.equal(before[n], after[n])]
        assert after.keys() == before.keys() and not changed, f"{label}: changed {changed}"
    # Not vacuous: the same refit with fresh scales goes through and changes weights and scales.
    rep = refit(llm, new, kv_recipe, kv_scales=KVScales(good, calibrated_for=4), weights_version=4)
    assert rep.kv_layers and rep.parity is not None and rep.parity.differing == ()
    after = _engine_state(llm, recipe)
    assert not torch.equal(before[q], after[q])
    assert after["model.layers.1.self_attn.attn|k"].view(torch.float64).item() == 2.0


def test_patch_is_idempotent_and_refuses_other_settings(engine, recipe):
    from nemo_jetrl.vllm_patch import PatchConflict, apply_patches
    from nemo_jetrl.vllm_patch.kernel import fp8_block_registry, registered_kernel

    before = {k: list(v) for k, v in fp8_block_registry().items()}
    again = apply_patches(recipe)
    assert again.active and {k: list(v) for k, v in fp8_block_registry().items()} == before
    assert registered_kernel() is not None
    fp32 = recipe.with_(
        rollout=recipe.rollout.with_(pow2_weight_scales=False, pow2_activation_scales=False)
    )
    with pytest.raises(PatchConflict, match="already applied"):
        apply_patches(fp32)


def test_after_revert_vllm_is_unpatched(rollout, model_dir, recipe, monkeypatch, capfd):
    """Last test of the module: revert, then a block-FP8 engine is plain vLLM again."""
    from nemo_jetrl.vllm_patch import build_engine_kwargs
    from nemo_jetrl.vllm_patch.kernel import registered_kernel
    from nemo_jetrl.vllm_patch.settings import ENV_VAR
    from nemo_jetrl.vllm_patch.shutdown import shutdown_engine

    handle = rollout.patch
    handle.revert()
    handle.revert()  # idempotent
    assert not handle.active
    assert ENV_VAR not in os.environ
    assert registered_kernel() is None
    rollout.close()  # shuts the engine down (the patch is already reverted)

    # Plain vLLM CPU has no block-FP8 kernel for this CPU: engine start fails the way it does
    # without our package (0.32: only AMX kernels, the selector says so; 0.20: no CPU entry in the
    # registry at all, the worker dies on the missing key, the one we created and removed). On
    # AMX CPUs (0.25, 0.32) and GPUs vLLM's own kernel is chosen instead.
    import vllm as _vllm
    from vllm import LLM

    from nemo_jetrl.vllm_patch.compat import release

    plain_error = (
        "KeyError: <PlatformEnum.CPU"
        if release(_vllm.__version__) < (0, 21, 0)
        else "Failed to find a kernel that can implement the ScaledMM linear layer"
    )
    kw = build_engine_kwargs(recipe, USER_KWARGS).kwargs
    # Engine core in this process, so the root cause arrives as the exception itself.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm.envs

    try:
        from vllm.platforms import current_platform

        amx_kernels = (
            release(_vllm.__version__) >= (0, 21, 0) and torch.cpu._is_amx_tile_supported()
        )
        if not current_platform.is_cpu() or amx_kernels:
            plain = LLM(model=str(model_dir), **kw)
            kernels = set(plain.collective_rpc("jetrl_kernels")[0].values())
            assert "JetRLFp8BlockLinearKernel" not in kernels, kernels
            shutdown_engine(plain)
        else:
            with pytest.raises(Exception) as ei:
                LLM(model=str(model_dir), **kw)
            # The root cause is in the exception (0.32, engine core in this process) or in the
            # worker process's log (0.20's CPU platform always runs a separate worker).
            captured = capfd.readouterr()
            msg = _chain(ei.value) + captured.out + captured.err
            assert plain_error in msg
    finally:
        vllm.envs.disable_envs_cache()


def _chain(exc: BaseException) -> str:
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)
