"""Refit into both of vLLM's CPU GEMM paths for unquantized linears, on any x86 CPU.

After loading, vLLM's CPU build hands each unquantized linear to
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``, which decides from the CPU
(``torch.cpu._is_amx_tile_supported``, ``_supports_onednn`` of the loaded ``_C`` library, whether
oneDNN can build a primitive for the dtype, ``current_platform.is_zen_cpu``):

* **repacked**: the GEMM reads a packed copy (oneDNN / AMX "SGL" / zentorch) and ``weight`` is
  replaced by an empty tensor (``lm_head`` keeps its parameter *and* a packed copy). oneDNN
  builds a BF16 primitive only on AVX-512 CPUs, but an FP32 one on every x86 CPU;
* **in place**: ``F.linear`` on the parameter (BF16 on CPUs without AVX-512).

Which branch each engine takes is asked of vLLM's own dispatch function, never assumed. The
oneDNN branch does not exist everywhere (vLLM 0.20's AVX2 library has no oneDNN; 0.32's builds
FP32 primitives on any x86 CPU but BF16 ones only with AVX-512), so the engines marked
``standin`` load ``tests/vllm_patch/standins/jetrl_onednn_standin.py`` (through
``vllm_fixtures.onednn_standin``), a labelled pure-torch stand-in for the three oneDNN calls
(its packed weight is a private copy, as oneDNN's is): vLLM's own
dispatch, repacking and reload code then runs its oneDNN branch on every CPU and version, and the
unmarked engines run whatever this CPU really does. A refit that
only copied into parameters would fail the shape guard (repacked weights) or leave the packed
copies stale; both are caught here by the parity read-back through the layer's own GEMM and by
logprobs against the trainer.

Refits that fail after tensors reached the engine are rolled back (issue 17; these tests were
tests/vllm_patch/test_vllm_rollback.py). `refit.refit` checks every input before sending; what
can still fail is in the engine: the loader raising half way, the parity check finding a
difference. Both are injected in the worker (closures sent by value, test-only
``VLLM_ALLOW_INSECURE_SERIALIZATION``) around the real loader: after each failure the engine's
read-back state (FP8 bytes, scales, other tensors, GEMM views, KV scales) equals the state before
the refit bit for bit, and greedy generation gives the same tokens and logprobs. The mutation
(``rollback=False``) leaves the engine changed. Each rollback case runs on three engines: jetrl as
this CPU runs it, and jetrl and BF16 with the stand-in, where a half-load makes vLLM build new
GEMM closures and the rollback must put the old ones back (checked by identity, and by reading
every weight back through its GEMM).

Engines (issue 40): both kinds of test share one engine per (dtype, recipe, stand-in), started
once by ``dense_engines.EnginePool`` (5 starts, not 8); the rollback tests first refit a known
state (seed 0) and compare against a read-back taken in the same engine.
"""

from __future__ import annotations

import pytest
import torch
from dense_engines import (
    KEYS,
    EnginePool,
    changed,
    gemm_closures,
    has_snapshot,
    inject,
    remove_fault,
)
from hf_models import tiny_llama_128
from test_vllm_engine import _engine_state, _generate, _token_logprobs
from vllm_fixtures import (
    DECODER_LINEARS,
    bf16_gap_bound,
    bf16_rounding_gap,
    fp8_gap_bound,
    logprob_gap,
    onednn_standin,
    vllm_cpu_env,
    vllm_repacks,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_env():
    with vllm_cpu_env():
        yield


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = EnginePool(tmp_path_factory)
    yield p
    p.close()


@pytest.fixture(scope="module")
def engine_key(request):
    """The engine a test runs on (indirect, module scope: pytest runs each engine's tests
    together, so each engine starts once)."""
    return KEYS[request.param]


def test_with_the_standin_vllm_repacks_on_this_cpu():
    """The premise of the ``standin`` engines: vLLM's dispatch then takes its oneDNN branch."""
    with onednn_standin(True):
        assert vllm_repacks(torch.bfloat16) and vllm_repacks(torch.float32)


def _trainer(seed: int, dtype: torch.dtype, recipe_name: str):
    from nemo_jetrl.fp8.config import Fp8LinearConfig
    from nemo_jetrl.fp8.convert import convert_to_fp8_training

    model = tiny_llama_128(seed).to(dtype)
    if recipe_name == "jetrl":
        convert_to_fp8_training(
            model, Fp8LinearConfig(pow2_scales=True), module_filter_fn=lambda m, n: n != "lm_head"
        )
    return model


# vLLM's fp8 quantization serves bfloat16/float16 only, so jetrl runs in bfloat16; the FP32
# engine (BF16 recipe) is the one that repacks on every CPU, lm_head included. The BF16 recipe's
# engine-vs-trainer gaps, each bounded by the trainer's own BF16-vs-FP32 gap on the same tokens
# (vllm_fixtures.bf16_gap_bound), are the controls of the jetrl engine's gaps for the same dtype,
# stand-in and weights (vllm_fixtures.fp8_gap_bound): measured by the BF16 engine's test first
# (or, where that test did not run first, by it inside the jetrl one). Fixed bounds before: 0.05
# (FP32), 0.25 (BF16) and 0.25 (jetrl) nats; stale packed copies (the dummy weights) gave 1.5-3.3
# nats on AVX-512 CPUs.
@pytest.mark.parametrize("engine_key", list(KEYS), indirect=True)
def test_refit_rebuilds_what_vllm_derives_from_the_weights(pool, engine_key):
    key = engine_key
    controls = None
    if key.recipe_name == "jetrl":
        bf16 = KEYS[key.id.replace("jetrl", "bf16")]
        if bf16 not in pool.gaps:
            pool.gaps[bf16] = _check_refits(pool, bf16, None)
        controls = pool.gaps[bf16]
    gaps = _check_refits(pool, key, controls)
    if key.recipe_name == "bf16":
        pool.gaps[key] = gaps


def _check_refits(pool: EnginePool, key, controls):
    """``key``'s engine as loaded (dummy weights, then the initial refit) and refitted; returns
    its logprob gap to the trainer for seeds 0 and 1 (the controls of an FP8 engine that
    follows)."""
    from test_vllm_engine import PROMPTS

    from nemo_jetrl.vllm_patch.refit import ParityError, check_parity, quantize_state_dict

    dtype_name, recipe_name = key.dtype_name, key.recipe_name
    # fresh: it checks the initial refit's report and the weights it loaded (seed 0)
    eng = pool.get(key, fresh=True)
    dtype = getattr(torch, dtype_name)
    repacks = vllm_repacks(dtype)  # in-process, under the engine's stand-in (if any)
    assert repacks or not key.standin
    recipe = eng.recipe
    llm = eng.llm
    repacked = set(llm.collective_rpc("jetrl_repacked")[0])
    bf16_linears = DECODER_LINEARS if recipe_name == "bf16" else set()
    assert repacked == (bf16_linears if repacks else set()), (repacks, sorted(repacked))
    rep = eng.last_refit.parity
    assert rep is not None and rep.differing == ()
    # embed_tokens and lm_head, plus every decoder linear the recipe keeps unquantized
    assert rep.through_kernel == 2 + (14 if recipe_name == "bf16" else 0)  # HF tensors
    assert rep.compared == len(tiny_llama_128(0).state_dict()) + rep.fp8 // 2

    gaps = []
    for seed in (0, 1):
        if seed:  # a second refit changes what the engine computes; it tracks the new trainer
            eng.refit(tiny_llama_128(seed).to(dtype).state_dict())
        out = _generate(llm, logprobs=0)
        trainer = _trainer(seed, dtype, recipe_name)
        gap = logprob_gap(out, trainer)
        if recipe_name == "bf16":
            control, what = bf16_rounding_gap(out, trainer), "the trainer's BF16-vs-FP32 gap"
            bound = bf16_gap_bound(control)
        else:
            control, what = controls[seed], "the BF16 recipe's engine-vs-trainer gap"
            bound = fp8_gap_bound(control)
        print(f"{dtype_name} {recipe_name} seed {seed}: gap {gap:.4f}, control {control:.4f}")
        assert gap < bound, (
            f"{dtype_name} engine, {recipe_name} recipe, weights of seed {seed}: logprobs "
            f"{gap:.4f} nats from the trainer's, bound {bound:.4f} from {what} {control:.4f}"
        )
        gaps.append(gap)

    # The read-back is not vacuous: against other weights it names the unquantized linears
    # through their GEMM (the only copy a repacked layer has).
    other = quantize_state_dict(tiny_llama_128(2).to(dtype).state_dict(), recipe, dtype=dtype)
    with pytest.raises(ParityError) as ei:
        check_parity(llm, other)
    msg = str(ei.value)
    assert "lm_head.weight (through the layer's GEMM:" in msg
    for layer in bf16_linears:
        name = layer.replace("qkv_proj", "q_proj").replace("gate_up_proj", "up_proj")
        assert f"{name}.weight (through the layer's GEMM:" in msg, name
    assert len(PROMPTS) == 2
    return gaps


# The rollback tests' engines (ids as in the former test_vllm_rollback.py).
ROLLOUT = pytest.mark.parametrize(
    "engine_key",
    ["bf16-jetrl", "standin-bf16-jetrl", "standin-bf16-bf16"],
    ids=["jetrl", "standin-jetrl", "standin-bf16"],
    indirect=True,
)


def _rollout(pool: EnginePool, key):
    """The shared engine, refitted to a known state (seed 0, as the trainer sends it), with the
    stand-in engines' premise checked: vLLM took a repacking branch there."""
    eng = pool.get(key)
    eng.refit(tiny_llama_128(0).state_dict())
    if key.standin:
        # lm_head and the embedding (vLLM dispatches it too, keeping its weight) always
        embeddings = {"lm_head", "model.embed_tokens"}
        packed = set(gemm_closures(eng.llm))
        assert packed == embeddings | (DECODER_LINEARS if key.recipe_name == "bf16" else set())
        assert set(eng.llm.collective_rpc("jetrl_repacked")[0]) == packed - embeddings
    return eng  # without the stand-in: whatever this CPU does (AVX-512 repacks lm_head too)


@pytest.mark.parametrize(
    "fault, error, match",
    [
        ("half", "RefitError", r"refit failed in the engine \(.*injected loader failure after "),
        ("flip", "ParityError", r"(layers\.1\.mlp\.down_proj|embed_tokens)\.weight \(1 of "),
    ],
)
@ROLLOUT
def test_a_refit_failing_inside_the_engine_leaves_it_bit_identical(
    pool, engine_key, fault, error, match
):
    from nemo_jetrl.vllm_patch import refit as refit_mod

    rollout = _rollout(pool, engine_key)
    llm, recipe = rollout.llm, rollout.recipe
    before, out_before = _engine_state(llm, recipe), _generate(llm, logprobs=1)
    closures = gemm_closures(llm)
    inject(llm, fault)
    try:
        with pytest.raises(getattr(refit_mod, error), match=match) as ei:
            rollout.refit(tiny_llama_128(7).state_dict())
    finally:
        remove_fault(llm)
    assert "rolled back to its state before this refit" in str(ei.value)
    assert not changed(before, _engine_state(llm, recipe))
    assert gemm_closures(llm) == closures  # the same closure objects, not rebuilt copies
    out = _generate(llm, logprobs=1)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in out_before]
    assert _token_logprobs(out) == _token_logprobs(out_before)
    assert not has_snapshot(llm)  # restored and freed


@ROLLOUT
def test_without_rollback_the_same_failure_leaves_the_engine_changed(pool, engine_key):
    """The mutation: what the rollback undoes is real (half of another seed's weights load)."""
    rollout = _rollout(pool, engine_key)
    llm, recipe = rollout.llm, rollout.recipe
    before, closures = _engine_state(llm, recipe), gemm_closures(llm)
    inject(llm, "half")
    try:
        with pytest.raises(Exception, match="injected loader failure") as ei:
            rollout.refit(tiny_llama_128(7).state_dict(), rollback=False)
    finally:
        remove_fault(llm)
    assert "rolled back" not in str(ei.value)
    diff = changed(before, _engine_state(llm, recipe))
    assert diff, "the injected half-load changed nothing: the rollback test would be vacuous"
    if closures:  # lm_head sorts into the loaded half: vLLM rebuilt its packed closure
        rebuilt = {n for n, i in gemm_closures(llm).items() if closures.get(n) != i}
        assert "lm_head" in rebuilt, rebuilt
        assert "lm_head.weight" in diff, diff  # read back through the new closure
    # A good refit (with rollback: its snapshot is freed after) makes the engine whole again.
    rep = rollout.refit(tiny_llama_128(0).state_dict())
    assert rep.parity is not None and rep.parity.differing == ()
    assert not changed(before, _engine_state(llm, recipe))
    assert not has_snapshot(llm)


def test_the_worker_runs_in_this_process_and_the_engine_closes_here(pool):
    """Last in the module, on its last engine: with the engine core in this process the one
    worker runs here too, in vLLM's ``uni`` executor, on every vLLM line (0.20's CPU platform
    spawned it, through message queues: `vllm_cpu_env` keeps ``uni`` with the rehearsal's rule),
    as NeMo-RL's generation worker runs a TP=1 engine. Closing it through `shutdown_engine`
    releases the model and vLLM's model-parallel groups here: vLLM 0.20's model runner first
    synchronizes an accelerator, which raised on this machine (torch without one) before the
    model was dropped, and 0.20's core left the groups to the next engine."""
    import os

    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from nemo_jetrl.vllm_patch.shutdown import _executor_queues

    if pool.engine is None:  # run alone: any of the module's engines
        pool.get(next(iter(KEYS.values())))
    core = pool.engine.llm.llm_engine.engine_core
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    executor = core.engine_core.model_executor
    assert isinstance(executor, UniProcExecutor), type(executor)
    assert _executor_queues(core) == []
    runner = executor.driver_worker.worker.model_runner
    assert runner.model is not None
    pool.close()
    assert runner.model is None  # vLLM's shutdown ran to its end in this process
    # and its model-parallel groups went with it: the next engine here builds its own
    from vllm.distributed import parallel_state

    assert not parallel_state.model_parallel_is_initialized()
