"""The Ray driver's side of ``jetrl train --backend nemo-rl``, as NeMo-RL's ``examples/run_grpo.py``
runs it (v0.7.0 and main 7ea279a read): MasterConfig on NeMo-RL's defaults, tokenizer, data,
``grpo.setup`` with our policy worker, then the trainer ``run_grpo.py`` picks.

Everything a user can get wrong is checked in :func:`master_config`, before ``init_ray``: the
trainer kind (async GRPO and its unsupported features, NeMo-RL's TransferQueue data plane),
every path the config names (`paths.py`), the workers' Python (`venvs.py`), the vLLM version
in the vLLM workers' venv.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_jetrl.backends.nemo_rl.resources import resource_problems

SYNC = "sync"
ASYNC = "async"
# run_grpo.py refuses these with async GRPO (NotImplementedError there; a UserError here).
ASYNC_UNSUPPORTED = ("use_dynamic_sampling", "reward_scaling", "reward_shaping")


def _user_error(msg: str) -> Exception:
    from nemo_jetrl.errors import UserError

    return UserError(msg)


def _enabled(node: Any) -> bool:
    return bool(node.get("enabled")) if isinstance(node, Mapping) else bool(node)


def trainer_kind(cfg: Mapping[str, Any], gpus_of: Mapping[str, Any] | None = None) -> str:
    """``async`` when ``grpo.async_grpo.enabled`` (NeMo-RL's ``async_grpo_train``), else ``sync``;
    a UserError listing every `trainer_problems` entry together."""
    problems = trainer_problems(cfg, gpus_of)
    if problems:
        raise _user_error(
            "the nemo-rl backend cannot run this trainer:\n  - "
            + "\n  - ".join(f"{key}={why}" for key, why in problems)
        )
    return ASYNC if _async(cfg) else SYNC


def _async(cfg: Mapping[str, Any]) -> bool:
    return _enabled(((cfg.get("grpo") or {}).get("async_grpo") or {}).get("enabled", False))


def trainer_problems(
    cfg: Mapping[str, Any], gpus_of: Mapping[str, Any] | None = None
) -> list[tuple[str, str]]:
    """(key, why) for each reason the trainer ``run_grpo.py`` would pick cannot run: ``why``
    opens with the key's value and ends with what to set (``key=why`` reads as one sentence).

    NeMo-RL's split of the GPUs between training and vLLM (`resources.resource_problems`), of
    ``gpus_of`` when given (the user's config, where a rehearsal rewrote the cluster), else of
    ``cfg``.

    ``data_plane.enabled`` (NeMo-RL's TransferQueue trainer ``grpo_train_sync`` with its
    ``TQPolicy``: our policy worker and loss wrapper are not wired into it); with async GRPO, the
    features run_grpo.py refuses and what ``async_grpo_train`` asserts after Ray starts.
    """
    problems = resource_problems(cfg if gpus_of is None else gpus_of)
    if _enabled((cfg.get("data_plane") or {}).get("enabled", False)):
        problems.append((
            "data_plane.enabled",
            "true: NeMo-RL's TransferQueue trainer grpo_train_sync with TQPolicy is not "
            "supported by the nemo-rl backend: our policy worker, loss wrapper and mismatch "
            "metrics run with the legacy trainer only. Set data_plane.enabled=false.",
        ))  # fmt: skip
    if not _async(cfg):
        return problems
    grpo = cfg.get("grpo") or {}
    unsupported = [
        f"grpo.{k}" + ("" if k == "use_dynamic_sampling" else ".enabled")
        for k in ASYNC_UNSUPPORTED
        if k in grpo and _enabled(grpo[k])
    ]
    if (cfg.get("data") or {}).get("use_multiple_dataloader"):
        unsupported.append("data.use_multiple_dataloader")
    for key in unsupported:
        problems.append((
            key,
            "true: NeMo-RL's async GRPO (grpo.async_grpo.enabled=true) does not support it "
            "(examples/run_grpo.py refuses it); turn it off or async GRPO off",
        ))  # fmt: skip
    if (grpo.get("async_grpo") or {}).get("max_trajectory_age_steps") == 0:
        problems.append((
            "grpo.async_grpo.max_trajectory_age_steps",
            "0: NeMo-RL sizes its replay buffer num_prompts_per_step x age x 2, and a buffer of "
            "0 raises after Ray and model load; set it to 1 or more (or "
            "grpo.async_grpo.enabled=false for a synchronous run)",
        ))  # fmt: skip
    # async_grpo_train asserts these at its start, after Ray, model load and vLLM start
    # (nemo_rl/algorithms/grpo.py, v0.7.0 :3364, :3371, :3421): refused here, minutes earlier.
    generation = (cfg.get("policy") or {}).get("generation") or {}
    on_vllm = generation.get("backend", "vllm") == "vllm"
    if on_vllm and not (generation.get("vllm_cfg") or {}).get("async_engine", False):
        problems.append((
            "policy.generation.vllm_cfg.async_engine",
            "false: NeMo-RL's async GRPO needs vLLM's async engine: set "
            "policy.generation.vllm_cfg.async_engine=true",
        ))  # fmt: skip
    # v0.7.0 :3421 asserts it; main :4177 allows it for Megatron generation only
    colocated = (generation.get("colocated") or {}).get("enabled", True)
    if on_vllm and colocated is not False:
        problems.append((
            "policy.generation.colocated.enabled",
            f"{'true' if colocated is True else colocated}: NeMo-RL's async GRPO runs vLLM on "
            "its own GPUs: set policy.generation.colocated.enabled=false and give generation "
            "its GPUs (policy.generation.colocated.resources.gpus_per_node on one node, "
            ".num_nodes on several; training keeps the rest of the cluster)",
        ))  # fmt: skip
    if not (cfg.get("loss_fn") or {}).get("use_importance_sampling_correction", False):
        problems.append((
            "loss_fn.use_importance_sampling_correction",
            "false: NeMo-RL's async GRPO needs importance-sampling correction for its stale "
            "trajectories: set loss_fn.use_importance_sampling_correction=true",
        ))  # fmt: skip
    return problems


@dataclass
class DriverSetup:
    """What the driver needs after its checks: NeMo-RL's MasterConfig and how to run it."""

    config: Any
    kind: str
    policy_entry: str
    log_lines: list[str] = field(default_factory=list)


def prepare_master(
    merged: MutableMapping[str, Any],
    ours: Mapping[str, Any],
    *,
    nemo_rl_dir: Path,
    venv_base: Path,
    stock_entry: str,
    vllm_entry: str,
    vllm_patch: bool,
    environ: MutableMapping[str, str],
    next_log_dir: Any,
    preflight: Any,
    cwd: Path | None = None,
) -> tuple[str, str, list[str]]:
    """The checks and path/venv settings on the merged dict (NeMo-RL's defaults + ours), in place.

    Returns (trainer kind, registry entry for our policy worker, log lines). No Ray, no NeMo-RL
    import: NeMo-RL's ``get_next_experiment_dir`` and the vLLM preflight come in as callables.
    """
    from nemo_jetrl.backends.nemo_rl import venvs
    from nemo_jetrl.backends.nemo_rl.paths import PathProblem, resolve_config_paths
    from nemo_jetrl.backends.nemo_rl.resume_guard import resume_problem
    from nemo_jetrl.backends.nemo_rl.translate import POLICY_WORKER_FQN, STOCK_POLICY_WORKER
    from nemo_jetrl.build_info import mark_driver_code, shadowing_checkout

    kind = trainer_kind(merged, gpus_of=ours)  # a rehearsal rewrote merged's cluster
    shadow = shadowing_checkout(Path.cwd())  # Ray's, not ``cwd`` (where config paths resolve)
    if shadow:
        raise _user_error(shadow)
    # every Ray actor inherits the driver's environment (init_ray): the workers check it
    mark_driver_code(environ)
    try:
        lines = [f"path {c}" for c in resolve_config_paths(merged, ours, nemo_rl_dir, cwd)]
    except PathProblem as exc:
        raise _user_error(str(exc)) from None
    if why := resume_problem(merged):  # paths are absolute now, as NeMo-RL will read them
        raise _user_error(why)
    rebuild = venvs.force_rebuild(environ)
    entry, line, mcore_py = venvs.policy_worker_entry(
        stock_entry, STOCK_POLICY_WORKER, venv_base, rebuild, POLICY_WORKER_FQN
    )
    lines.append(line)
    vllm_py = venvs.venv_python(venv_base, venvs.vllm_worker_fqn(merged))  # sync or async
    uv_venvs = [
        py for ent, py in ((stock_entry, mcore_py), (vllm_entry, vllm_py)) if ent.startswith("uv")
    ]
    # built by an earlier launch that carried nemo_jetrl on PYTHONPATH only (bare metal)
    lacking = [
        py for py in uv_venvs if py.is_file() and not rebuild and not venvs.has_nemo_jetrl(py)
    ]
    if vllm_patch:
        from nemo_jetrl.backends.nemo_rl.vllm_refit import ENV_VAR as HOOK_ENV
        from nemo_jetrl.backends.nemo_rl.worker_env import worker_env_problems

        vllm_cfg = ((merged.get("policy") or {}).get("generation") or {}).get("vllm_cfg") or {}
        env_vars = vllm_cfg.get("env_vars") or {}
        bad = worker_env_problems(environ, env_vars, HOOK_ENV in env_vars)
        if bad:
            raise _user_error(
                "the vLLM workers would start without nemo_jetrl's kernel or refit hook (an "
                "off-policy rollout); nothing started:\n  - " + "\n  - ".join(bad)
            )
        if not vllm_entry.startswith("uv"):
            preflight(vllm_entry)
        elif vllm_py in lacking:  # asked with the overlay this launch will give it
            with tempfile.TemporaryDirectory() as tmp:
                preflight(str(vllm_py), venvs.write_overlay(Path(tmp) / venvs.OVERLAY_NAME))
        elif vllm_py.is_file() and not rebuild:
            preflight(str(vllm_py))
        else:
            lines.append(
                "vLLM version check (and the FP8 KV cache's platform) deferred to engine start "
                f"({vllm_py} is "
                + ("rebuilt by NeMo-RL" if rebuild else "not built yet")
                + "; the plugin refuses an unsupported vLLM there)"
            )
    logger = merged.setdefault("logger", {})
    logger["log_dir"] = str(
        next_log_dir(str(Path(cwd or Path.cwd()) / logger.get("log_dir", "logs")))
    )
    # NeMo-RL builds (first run, bare metal) or rebuilds (the flag) uv-managed venvs from its
    # own project during this run: those venvs lack nemo_jetrl unless the overlay is on the path.
    unbuilt = [str(py) for py in uv_venvs if not py.is_file()]
    if rebuild or unbuilt or lacking:
        stale = venvs.remove_stale_link(venv_base, POLICY_WORKER_FQN) if rebuild else None
        if stale:
            lines.append(stale)
        overlay = venvs.write_overlay(Path(logger["log_dir"]) / venvs.OVERLAY_NAME)
        policy = merged.setdefault("policy", {})
        for path in (("megatron_cfg",), ("generation", "vllm_cfg")):
            node = policy
            for p in path:
                node = node.setdefault(p, {})
            node["env_vars"] = venvs.with_pythonpath(node.get("env_vars") or {}, overlay)
        # and on this driver's own PYTHONPATH, which init_ray hands every Ray actor of the job:
        # NeMo-RL v0.7.0 starts the actor that imports our worker class
        # (RayWorkerBuilder.IsolatedWorkerInitializer, worker_groups.py :493) with its
        # py_executable alone, so it never sees megatron_cfg.env_vars (main passes PYTHONPATH)
        here = {"PYTHONPATH": environ.get("PYTHONPATH", "")}
        environ["PYTHONPATH"] = venvs.with_pythonpath(here, overlay)["PYTHONPATH"]
        if rebuild:
            why = f"{venvs.FORCE_REBUILD_ENV}=true: NeMo-RL rebuilds its worker venvs"
        elif unbuilt:
            why = "NeMo-RL builds " + ", ".join(unbuilt) + " during this run"
        else:
            why = "NeMo-RL's worker venvs " + ", ".join(map(str, lacking)) + " were built"
        lines.append(
            f"{why} without nemo_jetrl; put {overlay} (nemo_jetrl + its vLLM plugin entry "
            "point) first on the Megatron and vLLM workers' PYTHONPATH and on this driver's "
            "(every Ray actor of the run inherits it)"
        )
    return kind, entry, lines


def flushed(checkpointer: Any) -> contextlib.AbstractContextManager:
    """NeMo-RL main's ``CheckpointManager`` as the context its ``run_grpo.py`` enters: on any
    exit it finishes the background rename of the last ``tmp_step_N`` (a crash would otherwise
    leave it for resume to skip); v0.7.0's saves in the foreground and is no context manager."""
    return checkpointer if hasattr(type(checkpointer), "__exit__") else contextlib.nullcontext()


def train(
    config: Any,
    plan: Any,
    kind: str,
    max_age: int = 1,
    make_policy: Any = None,
    on_setup: Any = None,
) -> None:  # pragma: no cover
    """Tokenizer, data, ``grpo.setup`` with our policy worker, then the trainer for ``kind``, with
    the mismatch-metrics loss wrapper and logger proxy. ``make_policy(**kwargs)``: what builds
    the policy from ``grpo.setup``'s keywords (default NeMo-RL's ``Policy`` with our Megatron
    worker; ``jetrl rehearse`` passes its CPU policy); ``on_setup(policy, policy_generation)``:
    called after the engine check, before the first step. The NeMo-RL tier runs it whole through
    ``jetrl rehearse`` (tests/backends/test_nemo_rl_rehearse.py)."""
    from nemo_rl.algorithms import grpo
    from nemo_rl.algorithms.utils import get_tokenizer
    from nemo_rl.data.utils import setup_response_data
    from nemo_rl.models.generation import configure_generation_config
    from nemo_rl.models.policy.lm_policy import Policy

    from nemo_jetrl.backends.nemo_rl.engine_check import prove_generation_engines
    from nemo_jetrl.backends.nemo_rl.metrics import JetrlLoggerProxy, MismatchMetricsLoss

    tokenizer = get_tokenizer(config.policy["tokenizer"])
    megatron_cfg = config.policy.get("megatron_cfg") or {}
    config.policy["generation"] = configure_generation_config(
        config.policy["generation"],
        tokenizer,
        has_refit_draft_weights=bool(config.policy["draft"]["enabled"]),
        trains_mtp=bool(megatron_cfg.get("mtp_num_layers")),
    )
    dataset, val_dataset, task_to_env, val_task_to_env = setup_response_data(
        tokenizer, config.data, config.env
    )

    def policy_factory(**kwargs: Any) -> Any:
        if make_policy is not None:
            return make_policy(**kwargs)
        return Policy(**kwargs, worker_extension_cls_fqn=plan.workers.policy_worker_fqn)

    (
        policy,
        policy_generation,
        _gym,
        _cluster,
        dataloader,
        val_dataloader,
        loss_fn,
        logger,
        checkpointer,
        grpo_state,
        master_config,
        teachers,
        aliases,
    ) = grpo.setup(config, tokenizer, dataset, val_dataset, policy_factory=policy_factory)
    loss_fn = MismatchMetricsLoss(loss_fn)  # DEFAULT_RATIO_BOUNDS: the tags' one definition
    logger = JetrlLoggerProxy(logger)
    try:
        # every vLLM engine runs our kernel and refit hook, or the run stops here (engine_check)
        prove_generation_engines(policy_generation, plan.workers.vllm_env, logger)
        if on_setup is not None:
            on_setup(policy, policy_generation)
        if kind == ASYNC:
            print("jetrl: running NeMo-RL's async GRPO (grpo.async_grpo.enabled)", flush=True)
            grpo.async_grpo_train(
                policy=policy,
                policy_generation=policy_generation,
                dataloader=dataloader,
                val_dataloader=val_dataloader,
                tokenizer=tokenizer,
                loss_fn=loss_fn,
                task_to_env=task_to_env,
                val_task_to_env=val_task_to_env,
                logger=logger,
                checkpointer=checkpointer,
                grpo_save_state=grpo_state,
                master_config=master_config,
                max_trajectory_age_steps=max_age,
                teacher_worker_groups=teachers,
                alias_to_group_alias=aliases,
            )
        else:
            print("jetrl: running NeMo-RL's synchronous GRPO (grpo_train)", flush=True)
            with flushed(checkpointer):
                grpo.grpo_train(
                    policy,
                    policy_generation,
                    dataloader,
                    val_dataloader,
                    tokenizer,
                    loss_fn,
                    task_to_env,
                    val_task_to_env,
                    logger,
                    checkpointer,
                    grpo_state,
                    master_config,
                )
    finally:
        shut_down(grpo, policy_generation, task_to_env, val_task_to_env)


def shut_down(grpo: Any, generation: Any, task_to_env: Any, val_task_to_env: Any) -> None:
    """After the run, as NeMo-RL main's ``run_grpo.py``: the environments first (main's
    ``grpo.shutdown_environments``, "before generation stops"; v0.7.0 has none), then vLLM, each
    whatever the other raised; vLLM failing to stop is printed, never raised over the run's
    own error."""
    try:
        stop_envs = getattr(grpo, "shutdown_environments", None)
        if stop_envs is not None:
            stop_envs(task_to_env, val_task_to_env)
    finally:
        try:
            generation.shutdown()
        except Exception as exc:
            print(
                f"jetrl: vLLM generation did not shut down cleanly ({type(exc).__name__}: {exc})",
                file=sys.stderr,
                flush=True,
            )
