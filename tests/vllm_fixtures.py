"""Shared set-up of the `vllm` test modules (real vLLM CPU build, scripts/test_vllm.sh)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from nemo_jetrl.vllm_patch import uni_executor

# tests/vllm_patch/standins/jetrl_onednn_standin.py: a labelled stand-in for vLLM's oneDNN calls
STANDINS = Path(__file__).resolve().parent / "vllm_patch" / "standins"
# The decoder linears of tests/hf_models.tiny_llama_128 (2 layers) under vLLM's fused names.
DECODER_LINEARS = {
    f"model.layers.{i}.{m}"
    for i in range(2)
    for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
}


# torch.compile off in the vLLM engines' processes: vLLM's CPU sampler compiles one function
# (``compiled_random_sample``) at every engine's warm-up even with enforce_eager, and inductor's
# ISA probe and codegen made that 8-17 s of each ~37 s engine start on the 2-core EPYC (LLM()
# 36.9 s -> 20.1 s, vLLM 0.20; docs/ci_times.md). It only changes how that function draws its
# random numbers (eager exponential_); no test compares randomly sampled tokens with fixed ones,
# and a GPU serves with other sampler code. Engines built with enforce_eager=False pass compiled.
NO_COMPILE = ("TORCH_COMPILE_DISABLE", "1")


# set beside NO_COMPILE by `engines_without_compile`: a process that inherits both (a
# pytest-xdist worker of the session that set them) keeps torch.compile as its parent did
NO_COMPILE_BY_TESTS = "JETRL_TESTS_SET_TORCH_COMPILE_DISABLE"


def engines_without_compile() -> None:
    """For the session of a vLLM tier (tests/conftest.py): the engines' processes, spawned later,
    inherit `NO_COMPILE`; this process read torch's setting first and keeps torch.compile (tests
    that compile in-process, e.g. test_serving_bits.py, still do), and so do the session's
    pytest-xdist workers, which inherit the variable (torch read it when they imported it)."""
    import torch._dynamo.config  # reads TORCH_COMPILE_DISABLE now

    if os.environ.get(NO_COMPILE_BY_TESTS) == "1":  # ours, inherited: not the user's setting
        torch._dynamo.config.disable = False
    elif NO_COMPILE[0] not in os.environ:
        os.environ.update((NO_COMPILE, (NO_COMPILE_BY_TESTS, "1")))


# The engine core in the test's process (vLLM's default: a spawned process; two fresh interpreters
# importing torch and vLLM with the worker were ~30 of an engine's ~36 s start on the 2-core EPYC
# without AVX-512; in-process 3-9 s; the 0.32 tier 904 -> 471 s, docs/ci_times.md), and with one
# worker the worker too (vLLM's ``uni`` executor): NeMo-RL's VllmGenerationWorker runs a TP=1
# engine so on a GPU (VLLM_ENABLE_V1_MULTIPROCESSING=0). vLLM 0.20's CPU platform turns ``uni``
# into ``mp`` and spawns the worker all the same; `vllm_cpu_env` keeps ``uni`` there with the
# rule the rehearsal uses (nemo_jetrl.vllm_patch.uni_executor), as 0.25+ do themselves. A TP=2
# engine's workers are spawned (``mp``), through message queues whose sockets vLLM 0.20's shutdown
# leaves open: `shutdown.shutdown_engine` closes them (a test module's teardown hung in zmq's
# Context.term before). vLLM keeps its process groups in module globals that an engine's
# shutdown tears down: a module that starts a second engine while its own lives runs its own
# with ``in_process=False``.
IN_PROCESS = uni_executor.MULTIPROCESSING


@contextmanager
def vllm_cpu_env(compiled: bool = False, in_process: bool = True) -> Iterator[None]:
    """CPU build: KV cache size in GiB of host memory (small: shared machine); no core pinning
    (the value that means that differs by vLLM version, see compat.cpu_omp_threads_bind); for a
    ``compiled`` engine (enforce_eager=False) torch.compile back on in its processes (the
    session turned it off: `engines_without_compile`); the engine core ``in_process``, and a
    one-worker engine's worker with it, as NeMo-RL's generation worker runs them (`IN_PROCESS`;
    the platform's own check restored on exit, and vLLM's model-parallel groups that a worker
    whose engine failed to start left in this process released). Variables the caller
    already set are kept; the rest are restored on exit, and so is vLLM's reading of them: an
    engine core started in this process turns on vLLM's cache of its environment variables
    (``vllm.envs.enable_envs_cache``), after which a later test's ``VLLM_*`` setting in this
    process was not read (seen on vLLM 0.20: ``VLLM_DEEP_GEMM_WARMUP=full`` read as the default,
    and a TP=2 engine given another module's ``VLLM_CPU_OMP_THREADS_BIND``)."""
    from vllm import envs as vllm_envs
    from vllm.distributed import parallel_state

    from nemo_jetrl.vllm_patch import cpu_fixes
    from nemo_jetrl.vllm_patch.compat import cpu_omp_threads_bind

    cached = getattr(vllm_envs, "_is_envs_cache_enabled", lambda: True)()
    with contextlib.ExitStack() as undo, pytest.MonkeyPatch.context() as mp:
        if not cached:  # ours to turn off again, after the engines of this context
            undo.callback(vllm_envs.disable_envs_cache)
        if not parallel_state.model_parallel_is_initialized():
            # vLLM's groups a worker built here and no shutdown tore down: an engine whose start
            # failed in this process (on 0.20 a MoE engine after it found them and built no EP
            # group); a closed engine's went with it (`shutdown.shutdown_engine`)
            undo.callback(_release_groups_left, parallel_state)
        if compiled:  # the engine's own torch.compile must run
            mp.delenv(NO_COMPILE[0], raising=False)
        for key, value in (
            ("VLLM_CPU_KVCACHE_SPACE", "1"),
            (IN_PROCESS, "0" if in_process else "1"),
            ("VLLM_CPU_OMP_THREADS_BIND", cpu_omp_threads_bind()),
            (cpu_fixes.ENV, "1"),  # as the product's CPU engines (vllm_rollout.cpu_engine_env)
        ):
            if key not in os.environ:
                mp.setenv(key, value)
        if in_process:  # a one-worker engine's worker in this process too (`IN_PROCESS`)
            from vllm.platforms import current_platform

            platform = type(current_platform)
            mp.setattr(platform, "check_and_update_config",
                       uni_executor.keep_uni_executor(platform))  # fmt: skip
        yield


def _release_groups_left(parallel_state) -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.cleanup_dist_env_and_memory()


@contextmanager
def onednn_standin(active: bool, monkeypatch=None):
    """The stand-in plugin for this process (in-process checks) and, through the environment,
    for vLLM's engine processes; everything restored on exit."""
    if not active:
        yield
        return
    sys.path.insert(0, str(STANDINS))
    import jetrl_onednn_standin as standin

    saved = standin.apply()
    if monkeypatch is not None:
        monkeypatch.setenv(standin.ENV, "1")
        path = os.pathsep.join([str(STANDINS), os.environ.get("PYTHONPATH", "")])
        monkeypatch.setenv("PYTHONPATH", path)
    try:
        yield
    finally:
        standin.revert(saved)
        sys.path.remove(str(STANDINS))


def vllm_repacks(dtype: torch.dtype) -> bool:
    """Ask vLLM's own CPU dispatch (in this process) whether it repacks a [256, 256] weight."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # the _C library vLLM loads for this CPU
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(256, 256, dtype=dtype), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    return layer.weight.numel() == 0


# Engine-vs-trainer logprob tolerances (issue 25). A fixed number of nats is no bound: how far
# vLLM's BF16 parts (norms, attention, lm_head: on AVX-512/AMX CPUs oneDNN/AMX kernels, under
# torch.compile inductor's fused code) round from HF's eager ones depends on the CPU. Every such
# tolerance is a multiple of a control measured in the same test, on the same CPU and engine
# mode; the bit-for-bit checks (FP8 bytes, scales, parity read-back) stay as they are.
#
# * BF16 recipe (no FP8 anywhere): control = ``bf16_rounding_gap``, how far the BF16 trainer is
#   from the same weights in FP32 on the engine's tokens (what BF16 rounding alone does to this
#   model's logprobs here). Another set of BF16 kernels, the engine's, lands within
#   BF16_GAP_PER_ROUNDING_GAP of it. Measured (AMX Xeon, vLLM 0.32, seeds 0-5, eager and
#   compiled): engine gap 0.016-0.053, control 0.025-0.056, ratio <= 1.6.
# * FP8 recipe: control = ``bf16_recipe_gap``, the BF16 recipe's engine-vs-BF16-trainer gap on
#   the same checkpoint, prompts and engine mode. Rounding differences upstream of an FP8 cast flip
#   FP8 values, so the FP8 gap is a multiple of it. Measured (same runs): FP8 gap 0.105-0.272,
#   ratio to the control 2.7-8.5 (AVX2: 0.125 / 0.027 = 4.6).
# The floors keep a bound from collapsing where a control happens to be tiny (a CPU whose BF16
# kernels round like HF's); they are a fifth of the smallest gap measured for the recipe. The
# defects these bounds catch are far out: stale or dummy weights 1.5-3.3 nats, FP8 weights with
# scales off by 2x (the mutation in test_vllm_engine) several nats.
# * FP8 mixture-of-experts: a rounding difference upstream of an FP8 cast or of a router can flip
#   an expert choice, and the BF16 control does not see how often this model does that. Second
#   control, trainer side only (`fp8_rounding_gap`): our FP8 forward with its non-FP8 parts in
#   BF16 vs FP32 on the engine's tokens, i.e. what another rounding of the same computation does
#   to this model here. The engine (another set of BF16 kernels) lands within
#   FP8_GAP_PER_FP8_ROUNDING_GAP of it (`moe_fp8_gap_bound`: the larger of the two bounds).
#   Measured on AMD EPYC (AVX-512, no AMX), vLLM 0.32: engine gap 0.291 (tiny Qwen3-MoE) and
#   0.497 (with a shared expert) against BF16 controls 0.024 / 0.040 (ratios 12.2 / 12.4, past
#   the dense 10); the FP8 rounding control on the engine's tokens 0.229 / 0.458 (ratios 1.27 /
#   1.09; the BF16 model's own BF16-vs-FP32 gap is ~0.04: FP8 casts and routing amplify ~10x).
BF16_GAP_PER_ROUNDING_GAP = 3.0
BF16_GAP_FLOOR = 0.003
FP8_GAP_PER_BF16_GAP = 10.0
FP8_GAP_FLOOR = 0.02
FP8_GAP_PER_FP8_ROUNDING_GAP = 2.0
# Experts split over expert-parallel ranks: each rank's partial sum is rounded to BF16 before
# vLLM's cross-rank reduce, one rounding the single-process reference does not have (every MoE
# call itself is checked bit for bit). Measured (vLLM 0.20, AMD EPYC, TP 2): EP gap 0.677 against
# an FP8 rounding control of 0.233 (2.9x); TP 0.141 against 0.190.
EP_FP8_GAP_PER_FP8_ROUNDING_GAP = 4.0


def bf16_gap_bound(rounding_gap: float) -> float:
    """Largest engine-vs-trainer gap (nats) allowed to a BF16-recipe engine, from its control."""
    return BF16_GAP_PER_ROUNDING_GAP * rounding_gap + BF16_GAP_FLOOR


def fp8_gap_bound(bf16_gap: float) -> float:
    """Largest engine-vs-FP8-trainer gap (nats) allowed to an FP8 engine, from its control."""
    return FP8_GAP_PER_BF16_GAP * bf16_gap + FP8_GAP_FLOOR


def hf_logprobs(model, o) -> torch.Tensor:
    """The HF model's logprob of each token vLLM generated in request output ``o``."""
    n = len(o.prompt_token_ids)
    ids = torch.tensor([list(o.prompt_token_ids) + list(o.outputs[0].token_ids)])
    with torch.no_grad():
        logits = model(ids).logits.float()
    logp = torch.log_softmax(logits[0, n - 1 : -1], dim=-1)
    return logp.gather(1, torch.tensor(o.outputs[0].token_ids)[:, None])[:, 0]


def engine_logprobs(o) -> torch.Tensor:
    """The engine's logprob of each token it generated in request output ``o`` (all finite)."""
    c = o.outputs[0]
    lps = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)])
    assert bool(torch.isfinite(lps).all()), lps
    return lps


def logprob_gap(outs, model) -> float:
    """Largest |engine - trainer| logprob (nats) over the tokens of ``outs``."""
    return max(float((engine_logprobs(o) - hf_logprobs(model, o)).abs().max()) for o in outs)


def bf16_rounding_gap(outs, model) -> float:
    """Control for a BF16 engine: largest |BF16 - FP32| logprob of the HF ``model`` (any dtype;
    a copy is cast) over the tokens of ``outs``."""
    import copy

    bf16, fp32 = copy.deepcopy(model).to(torch.bfloat16), copy.deepcopy(model).to(torch.float32)
    return max(float((hf_logprobs(bf16, o) - hf_logprobs(fp32, o)).abs().max()) for o in outs)


def fp8_rounding_gap(outs, fp8_model) -> float:
    """MoE control for an FP8 engine: `bf16_rounding_gap` of our FP8 forward ``fp8_model`` (its
    FP8 layers quantize whatever dtype reaches them; FP8 bytes of BF16 masters are the same)."""
    return bf16_rounding_gap(outs, fp8_model)


def moe_fp8_gap_bound(
    bf16_gap: float, fp8_rounding: float, per_rounding: float = FP8_GAP_PER_FP8_ROUNDING_GAP
) -> float:
    """Largest engine-vs-FP8-trainer gap allowed to an FP8 MoE engine, from both controls."""
    return max(fp8_gap_bound(bf16_gap), per_rounding * fp8_rounding)


def bf16_recipe_gap(model_dir, engine_kwargs: dict, generate, trainer) -> float:
    """Control for an FP8 engine: the BF16 recipe's engine on the checkpoint in ``model_dir``
    (same engine kwargs otherwise, e.g. eager or compiled), its outputs from ``generate(llm)``,
    against ``trainer`` (that checkpoint in HF, BF16). Runs under whatever patch is applied (it
    has no FP8 layer for our kernel to serve); the engine is shut down before returning."""
    from vllm import LLM

    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import build_engine_kwargs
    from nemo_jetrl.vllm_patch.shutdown import shutdown_engine

    kwargs = build_engine_kwargs(Recipe.preset("bf16"), engine_kwargs).kwargs
    llm = LLM(model=str(model_dir), **kwargs)
    try:
        outs = generate(llm)
    finally:
        shutdown_engine(llm)
    return logprob_gap(outs, trainer)


@contextmanager
def served_checkpoint(model, directory: Path, recipe, engine_kwargs: dict) -> Iterator:
    """``model`` saved with the char tokenizer to ``directory`` and served by a
    `VllmRolloutEngine` under ``recipe`` (loaded by its first refit); closed after."""
    import gc

    from hf_models import char_tokenizer

    from nemo_jetrl.vllm_patch.engine import VllmRolloutEngine

    model.save_pretrained(directory)
    char_tokenizer().save_pretrained(directory)
    eng = VllmRolloutEngine(directory, recipe, engine_kwargs=engine_kwargs)
    try:
        yield eng
    finally:
        eng.close()
        gc.collect()


def generate_each(llm, prompts, sampling_params) -> list:
    """``llm.generate`` one prompt per call, so repeated calls compare bit for bit.

    vLLM's engine core (its own process) starts a step as soon as it holds one request, so
    ``llm.generate(prompts)`` is scheduled as one batch or as [the first request(s) alone, then the
    rest], by when the others arrive. vLLM's BF16 GEMMs on CPU (the lm_head) are not batch
    invariant, so a prompt's last-position logits then move in their last bits: "0123456" on the
    tiny Qwen2-MoE gave -2.1052492 batched, -2.1052327 alone, and failed an exact refit-back
    comparison in the fresh-clone CI runs of 32b4941 and cf3c66a. One request runs one batch.
    """
    return [llm.generate([p], sampling_params, use_tqdm=False)[0] for p in prompts]
