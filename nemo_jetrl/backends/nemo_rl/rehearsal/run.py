"""``jetrl rehearse CONFIG``: the launch of ``jetrl train CONFIG --backend nemo-rl``, on CPU.

What runs is the launch's own code: `launch.prepare` (config check, on-policy gate,
translation), `driver.prepare_master` (every path, the workers' Python, the vLLM version,
async checks), NeMo-RL's ``MasterConfig``, then `driver.train`: NeMo-RL's tokenizer loader,
``setup_response_data`` (its math environment as Ray actors), ``grpo.setup`` (its virtual
cluster, its ``VllmGeneration`` with our plugins in its vLLM workers, its loss function, logger
and checkpointer), our engine check through NeMo-RL's worker group, and ``grpo_train`` for
`STEPS` steps with a refit (our hook and parity check) at each.

Replaced, because it cannot run here: the model (the config's family shrunk, `model.py`), the
data (a few sums in NeMo-RL's ``ResponseDataset`` jsonl), the cluster size (one logical GPU on a
local Ray, `engines.py`), the Megatron policy workers (`policy.py`), and what NeMo-RL's vLLM
worker needs a GPU for (`cpu_worker.py`). docs/rehearsal.md lists each with the test that pins it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STEPS = 2
_REMOVE = object()  # rehearsal_keys: the key goes
PROMPTS_PER_STEP = 2
REPLAY_NOTE = (
    "policy.router_replay.enabled: vLLM records each token's experts and NeMo-RL hands them to "
    "the policy, but the rehearsal's CPU policy routes with its own router: replay itself is "
    "not rehearsed"
)
GENERATIONS = 2


def _user_error(msg: str) -> Exception:
    from nemo_jetrl.errors import UserError

    return UserError(msg)


def rehearsal_keys(work: Path, model: Path, prompts: Path, hybrid: bool = False) -> dict[str, Any]:
    """The keys a rehearsal sets on the merged config (dotted key -> value); ``hybrid``: the
    stand-in is Qwen3.5's (`hybrid.vllm_keys`: what vLLM's CPU engine needs for it)."""
    from nemo_jetrl.backends.nemo_rl.rehearsal.hybrid import vllm_keys

    rows = PROMPTS_PER_STEP * GENERATIONS
    return {
        **(vllm_keys() if hybrid else {}),
        "policy.model_name": str(model),
        "policy.tokenizer.name": str(model),
        "policy.tokenizer.chat_template": _REMOVE,  # the stand-in tokenizer's own template
        "policy.max_total_sequence_length": 256,
        "policy.train_global_batch_size": rows,
        "policy.train_micro_batch_size": GENERATIONS,
        "policy.logprob_batch_size": GENERATIONS,
        "policy.dynamic_batching.enabled": False,
        "policy.sequence_packing.enabled": False,
        "policy.generation.max_new_tokens": 8,
        "policy.generation.vllm_cfg.tensor_parallel_size": 1,
        "policy.generation.vllm_cfg.pipeline_parallel_size": 1,
        "policy.generation.vllm_cfg.expert_parallel_size": 1,
        "policy.generation.vllm_cfg.max_model_len": 256,
        "policy.generation.vllm_cfg.enforce_eager": True,
        # and vLLM's CPU sampler eager too (its one torch.compile left: 8-17 s of inductor ISA
        # probes and codegen per engine on 2 cores; a GPU samples with other code)
        "policy.generation.vllm_cfg.env_vars.TORCH_COMPILE_DISABLE": "1",
        "policy.generation.vllm_cfg.async_engine": False,
        "policy.generation.colocated.enabled": True,
        "grpo.num_prompts_per_step": PROMPTS_PER_STEP,
        "grpo.num_generations_per_prompt": GENERATIONS,
        "grpo.max_num_steps": STEPS,
        "grpo.max_num_epochs": 1,
        "grpo.val_period": 0,
        "grpo.val_at_start": False,
        "grpo.val_at_end": False,
        "data.shuffle": False,
        "data.num_workers": 0,
        "data.train": {
            "dataset_name": "ResponseDataset",
            "data_path": str(prompts),
            "input_key": "input",
            "output_key": "output",
            "split_validation_size": 0,
        },
        "data.validation": None,
        "env.math.num_workers": 1,
        "cluster.num_nodes": 1,
        "cluster.gpus_per_node": 1,
        "logger.log_dir": str(work / "logs"),
        "logger.tensorboard_enabled": True,
        "logger.wandb_enabled": False,
        "logger.mlflow_enabled": False,
        "logger.swanlab_enabled": False,
        "logger.monitor_gpus": False,
        "checkpointing.enabled": True,
        "checkpointing.checkpoint_dir": str(work / "checkpoints"),
        "checkpointing.save_period": STEPS,
    }


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    if value is _REMOVE:
        node.pop(leaf, None)
    else:
        node[leaf] = value


def _parity_in_worker(worker: Any) -> Any:
    """In a vLLM worker: the last refit's parity report (then forgotten), or None."""
    runner = worker.model_runner
    rep = getattr(runner, "_jetrl_last_parity", None)
    runner._jetrl_last_parity = None
    return None if rep is None else {"compared": rep.compared, "fp8": rep.fp8}


def _parity_in_actor(actor: Any) -> Any:
    return actor.llm.collective_rpc(_parity_in_worker)


def _kv_in_actor(actor: Any) -> Any:
    from nemo_jetrl.backends.nemo_rl.rehearsal.kv import engine_kv_scales

    return actor.llm.collective_rpc(engine_kv_scales)


def _substitutes_in_worker(worker: Any) -> Any:
    """In a vLLM worker: the rehearsal's substitutes in effect there (None: none)."""
    from nemo_jetrl.backends.nemo_rl.rehearsal import cpu_worker

    handle = cpu_worker._HANDLE
    return list(handle.applied) if handle is not None and handle.active else None


def _substitutes_in_actor(actor: Any) -> Any:
    return actor.llm.collective_rpc(_substitutes_in_worker)


class _Watch:
    """What the rehearsal reads while NeMo-RL runs: the policy, the generation, each refit."""

    def __init__(self, recipe: Any, hook: bool) -> None:
        self.recipe = recipe
        self.hook = hook  # our refit hook is in the engines: each refit's parity is checked
        self.policy: Any = None
        self.generation: Any = None
        self.parity: list[Any] = []
        self.kv_problems: list[str] = []

    def make_policy(self, **kwargs: Any) -> Any:
        from nemo_jetrl.backends.nemo_rl.rehearsal.policy import make_cpu_policy_class

        self.policy = make_cpu_policy_class()(**kwargs, recipe=self.recipe)
        self.policy.after_refit = self.after_refit
        return self.policy

    def on_setup(self, policy: Any, generation: Any) -> None:
        import ray

        self.generation = generation
        futures = generation.worker_group.run_all_workers_single_data(
            "__ray_call__", fn=_substitutes_in_actor, run_rank_0_only_axes=["tensor_parallel"]
        )
        found = [w for engine in ray.get(futures) for w in engine]
        for rank, applied in enumerate(found):
            what = ", ".join(applied) if applied else "NONE (the rehearsal plugin did not run)"
            print(f"jetrl rehearse: vLLM worker {rank}: CPU substitutes in effect: {what}",
                  flush=True)  # fmt: skip

    def after_refit(self) -> None:
        import ray

        if self.generation is None:  # setup's own refit info, before the first step
            return
        if not self.hook:  # bf16 / fp8_rollout: NeMo-RL's own refit, vLLM's own quantizer
            self.parity.append([])
            print(f"jetrl rehearse: step {len(self.parity)}: refit by NeMo-RL's own code (no "
                  f"nemo_jetrl hook for recipe {self.recipe.name})", flush=True)  # fmt: skip
            return
        group = self.generation.worker_group
        futures = group.run_all_workers_single_data(
            "__ray_call__", fn=_parity_in_actor, run_rank_0_only_axes=["tensor_parallel"]
        )
        reports = [r for engine in ray.get(futures) for r in engine]
        step = len(self.parity) + 1
        if any(r is None for r in reports):
            print(f"jetrl rehearse: step {step}: refit parity NOT checked", flush=True)
        else:
            n = sum(r["compared"] for r in reports)
            fp8 = sum(r["fp8"] for r in reports)
            print(f"jetrl rehearse: step {step}: refit parity held, {n} tensors ({fp8} FP8) "
                  "identical to the trainer's", flush=True)  # fmt: skip
        self.parity.append(reports)
        if self.policy.kv_names:  # vLLM's cache is FP8: the scales the engine now uses
            self._kv_line(step)

    def _kv_line(self, step: int) -> None:
        import ray

        from nemo_jetrl.backends.nemo_rl.rehearsal.kv import kv_report

        futures = self.generation.worker_group.run_all_workers_single_data(
            "__ray_call__", fn=_kv_in_actor, run_rank_0_only_axes=["tensor_parallel"]
        )
        engines = [w for engine in ray.get(futures) for w in engine]
        kv = self.policy.kv
        line, differ = kv_report(self.policy.kv_sent, kv.vllm_scales if kv else None, engines)
        print(f"jetrl rehearse: step {step}: {line}", flush=True)
        for d in differ:
            print(f"jetrl rehearse:   - {d}", flush=True)
        self.kv_problems += [f"step {step}: {d}" for d in differ]


def _nemo_rl_dir() -> Path:
    import nemo_rl

    return Path(os.environ.get("NEMO_RL_DIR") or Path(nemo_rl.__file__).resolve().parents[1])


def rehearse(config: str, overrides: Sequence[str] = (), workdir: str | None = None) -> int:
    """The rehearsal (module docstring); 0 when ready for the cluster, 1 on the first problem,
    UserError (exit 2) for a bad config, as ``jetrl check``."""
    from nemo_jetrl.backends.nemo_rl import launch
    from nemo_jetrl.backends.nemo_rl.rehearsal import model as tiny
    from nemo_jetrl.backends.nemo_rl.rehearsal.workdir import prepared_in
    from nemo_jetrl.commands._output import make_output_dir

    start = time.monotonic()
    prepared = prepared_in(workdir, lambda: launch.prepare(config, overrides))
    plan = prepared.plan
    name = (plan.master_config.get("policy") or {}).get("model_name")
    arch = prepared.arch
    from nemo_jetrl.backends.nemo_rl.rehearsal.families import family_refusal, undescribed

    if arch is None or prepared.state_space:
        raise _user_error(undescribed(name, prepared.state_space))
    from nemo_jetrl.backends.nemo_rl.rehearsal.hybrid import text_config

    generation = (plan.master_config.get("policy") or {}).get("generation") or {}
    ignored = (generation.get("vllm_cfg") or {}).get("quantization_ignored_layer_kws") or ()
    refusal = family_refusal(arch, config, ignored)  # MLA, hybrid: asked of this env's vLLM
    if refusal:
        raise _user_error(refusal)
    try:
        tiny.tiny_config(arch, tiny.BLOCK)  # its family has a stand-in (before any work)
    except tiny.UnsupportedFamily as exc:
        raise _user_error(str(exc)) from None
    missing = launch.missing_dependencies()
    if missing:
        raise _user_error(
            "jetrl rehearse runs NeMo-RL's own code and needs it importable here; missing: "
            + ", ".join(missing)
            + " (the NeMo-RL tier's env: bash scripts/setup_nemo_rl_env.sh v0.7.0, then "
            "PYTHONPATH=$NEMO_RL_PYTHONPATH, see docs/rehearsal.md)"
        )
    from nemo_jetrl.backends.nemo_rl.rehearsal.kv import cpu_fp8_kv_refusal

    # an FP8 KV cache: asked of this Python's vLLM (the vLLM workers' Python), before any work
    vllm_cfg = ((plan.master_config.get("policy") or {}).get("generation") or {}).get("vllm_cfg")
    head_size = text_config(tiny.tiny_config(arch, tiny.BLOCK)).head_dim
    refusal = cpu_fp8_kv_refusal(vllm_cfg or {}, plan.recipe.name, head_size)
    if refusal:
        raise _user_error(refusal)
    work = Path(workdir or tempfile.mkdtemp(prefix=f"jetrl-rehearse-{Path(config).stem}-"))
    make_output_dir(work, "--workdir")
    work = work.resolve()
    model_dir = tiny.write_model(arch, work / "model")
    prompts = tiny.write_prompts(work / "data" / "prompts.jsonl")
    print(f"jetrl rehearse: {config}: recipe {plan.recipe.name}; {arch.name} -> "
          f"{tiny.LAYERS}-layer {arch.model_type} stand-in in {model_dir}", flush=True)  # fmt: skip
    return _run(prepared, work, model_dir, prompts, start)


def _run(prepared: Any, work: Path, model_dir: Path, prompts: Path, start: float) -> int:
    from nemo_rl.algorithms.grpo import MasterConfig
    from nemo_rl.distributed import ray_actor_environment_registry as reg
    from nemo_rl.utils.config import register_omegaconf_resolvers
    from nemo_rl.utils.logger import get_next_experiment_dir

    from nemo_jetrl.backends.nemo_rl import driver, launch, venvs
    from nemo_jetrl.backends.nemo_rl.rehearsal.engines import (
        cpu_generation_overrides,
        local_ray,
        system_python_workers,
    )
    from nemo_jetrl.backends.nemo_rl.translate import VLLM_PATCH_ENV

    plan = prepared.plan
    tree = _nemo_rl_dir()
    keys = rehearsal_keys(work, model_dir, prompts, hybrid=prepared.arch.hybrid is not None)
    merged = launch.merge_nemo_rl_defaults(
        plan.master_config, tree / "examples/configs/grpo_math_1B_megatron.yaml"
    )
    for k, v in keys.items():
        _set(merged, k, v)
    kind, _entry, lines = driver.prepare_master(
        merged, plan.master_config, nemo_rl_dir=tree, venv_base=venvs.venv_dir(),
        stock_entry=sys.executable, vllm_entry=sys.executable,
        vllm_patch=VLLM_PATCH_ENV in plan.workers.vllm_env, environ=os.environ,
        next_log_dir=get_next_experiment_dir,
        preflight=launch.vllm_preflight(plan, tree),
        cwd=work,
    )  # fmt: skip
    if kind != driver.SYNC:
        raise _user_error("jetrl rehearse runs NeMo-RL's synchronous GRPO only (async: not yet)")
    cpu_generation_overrides(merged["policy"]["generation"], str(model_dir), model_parallel=1)
    register_omegaconf_resolvers()
    config = MasterConfig(**merged)
    for line in lines:
        print(f"jetrl rehearse: {line}", flush=True)
    for w in prepared.warnings:
        print(f"jetrl rehearse: note: {w}", flush=True)
    if (merged["policy"].get("router_replay") or {}).get("enabled"):
        print(f"jetrl rehearse: note: {REPLAY_NOTE}", flush=True)
    log_dir = Path(config.logger["log_dir"])
    from nemo_jetrl.backends.nemo_rl.vllm_refit import ENV_VAR as HOOK_ENV

    watch = _Watch(plan.recipe, HOOK_ENV in plan.workers.vllm_env)
    failure = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(local_ray(gpus=1, cpus=4))
        stack.enter_context(system_python_workers(reg.ACTOR_ENVIRONMENT_REGISTRY, sys.executable))
        try:
            driver.train(config, plan, kind, make_policy=watch.make_policy,
                         on_setup=watch.on_setup)  # fmt: skip
        except Exception as exc:  # the first problem, named; the run is over
            failure = (exc, "".join(traceback.format_exception(exc)))
            traceback.clear_frames(exc.__traceback__)  # the objects its frames hold, freed below
        finally:
            _release(watch)
    return _report(watch, log_dir, config, failure, start)


def _release(watch: _Watch) -> None:
    """NeMo-RL's generation and the CPU policy shut down while our Ray still runs: NeMo-RL's
    ``VllmGeneration.__del__`` calls into Ray, and after ``ray.shutdown`` that call starts a new
    Ray and waits on it forever (a failed rehearsal hung instead of exiting 1)."""
    if watch.generation is not None:
        watch.generation.shutdown()  # idempotent: a second call (its __del__) finds no workers
        watch.generation = None
    if watch.policy is not None:
        watch.policy.shutdown()
    gc.collect()  # a half-built VllmGeneration (setup failed) is collected here, Ray still up


def _report(watch: _Watch, log_dir: Path, config: Any, failure: Any, start: float) -> int:
    from nemo_jetrl.runs.logs import read_run

    took = time.monotonic() - start
    print(f"jetrl rehearse: logs {log_dir} (TensorBoard: {log_dir}/tensorboard)", flush=True)
    print(f"jetrl rehearse: checkpoints {config.checkpointing['checkpoint_dir']}", flush=True)
    if failure is not None:
        exc, trace = failure
        print(f"{trace}jetrl rehearse: FAILED after {took:.0f} s: {type(exc).__name__}: {exc}",
              flush=True)  # fmt: skip
        return 1
    scalars = read_run(log_dir).scalars
    for key in ("train/token_mult_prob_error", "train/gen_kl_error"):
        series = scalars.get(key)
        values = "not logged"
        if series:
            pairs = zip(series.steps, series.values, strict=True)
            values = ", ".join(f"step {s}: {v:.6g}" for s, v in pairs)
        print(f"jetrl rehearse: {key}: {values}", flush=True)
    problems = []
    if len(watch.parity) < STEPS:
        problems.append(f"{len(watch.parity)} of {STEPS} refits checked")
    if watch.hook and any(not step or None in step for step in watch.parity):
        problems.append("a refit's parity was not checked (jetrl.refit_parity_check off?)")
    if watch.kv_problems:
        problems.append("KV scales differ in the engine: " + "; ".join(watch.kv_problems))
    if problems:
        print("jetrl rehearse: NOT ready: " + "; ".join(problems), flush=True)
        return 1
    print(f"jetrl rehearse: ready for the cluster ({STEPS} GRPO steps in {took:.0f} s)",
          flush=True)  # fmt: skip
    if watch.recipe.kv_fp8:  # vLLM's CPU attention served it; no CUDA attention does
        print(
            "jetrl rehearse: note: the FP8 KV cache ran on vLLM's CPU attention; a GPU launch "
            "refuses it before Ray (docs/kvcache.md): submit recipe jetrl there",
            flush=True,
        )
    return 0
