"""Proof at engine start that NeMo-RL's vLLM engines run our kernel and our refit hook.

In NeMo-RL nothing of ours starts the vLLM engine: each generation worker (a Ray actor of
``VllmGenerationWorker``) builds ``vllm.LLM`` in ``_create_engine`` with NeMo-RL's own
``worker_extension_cls`` (``VllmInternalWorkerExtension``), and our code reaches it only through
the two ``vllm.general_plugins`` entry points, armed by the env the launcher writes
(``NEMO_JETRL_VLLM_PATCH``: the kernel, ``vllm_patch/plugin.py``; ``NEMO_JETRL_NRL_REFIT``: the
refit hook, ``vllm_refit.py``). If they do not run (nemo_jetrl missing from a rebuilt venv, an
entry point not installed, ``VLLM_PLUGINS`` without them, ``VLLM_DISABLED_KERNELS`` naming our
kernel, a ``linear_backend`` other than auto) the rollout silently runs vLLM's own kernel and
NeMo-RL's own refit quantizer. So, after ``grpo.setup`` and before the first step, the driver
(`prove_generation_engines`, called by ``launch.py``) runs `check_in_generation_worker` in every
generation actor (Ray's ``__ray_call__``: no method of ours needs to exist there), which asks
every vLLM worker of its engine (``collective_rpc`` with `worker_status`, a plain function) for:

* the kernel of each block-FP8 linear (``guard.layer_kernel_report``), judged by the guard's
  own rule (``guard.kernel_problems``, as ``verify_engine_kernels`` does for the local engine);
* whether our refit hook is installed and in effect (``vllm_refit._PLUGIN_HANDLE``);
* which of our entry points this worker's Python has, and the variables that decide them;
* the attention implementation of each layer with an FP8 KV cache: FlashInfer folds the K/V
  scales it first sees into its own and never reads a refit's, and a backend taking FP8 queries
  (vLLM's ``query_quant``) quantizes the queries and the softmax probabilities, which the
  trainer's on-policy KV does not (`kv_backends`).

The same variables are judged before Ray starts, from the config (`worker_env`).

Each vLLM worker prints ``nemo_jetrl: plugin loaded in vLLM worker ...`` in its own log; the
actor prints ``nemo_jetrl: plugin loaded ... kernel serves N/N FP8 linears, refit hook
installed`` (an MoE: ``... and M/M FP8 expert layers (X experts)``); the driver logs
``jetrl/kernel/fp8_linears_on_our_kernel`` (a fraction of both, 1.0) and
``jetrl/kernel/refit_hook_installed`` at step 0. Anything missing raises `EngineNotProven`
naming the worker, the layers and the cause, and the run stops before its first step.

Not checked: a recipe whose rollout is not ours (bf16, fp8_rollout: no ``NEMO_JETRL_VLLM_PATCH``).
With ``vllm_cfg.async_engine`` vLLM's AsyncLLM answers ``collective_rpc`` only on its event
loop: `_async_step` sends it there (found through AsyncLLM's running output tasks) or, when
called on that loop, starts it as a task the driver polls for; with no loop found the driver
logs ``engine check NOT run``.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from nemo_jetrl.backends.nemo_rl.kv_backends import kv_backend_problems
from nemo_jetrl.vllm_patch.guard import KernelNotInEffect

FRACTION_METRIC = "jetrl/kernel/fp8_linears_on_our_kernel"
HOOK_METRIC = "jetrl/kernel/refit_hook_installed"
# Our vllm.general_plugins entry points (pyproject.toml): name -> target.
ENTRY_POINTS = {
    "nemo_jetrl": "nemo_jetrl.vllm_patch.plugin:load_in_worker",
    "nemo_jetrl_nemo_rl_refit": "nemo_jetrl.backends.nemo_rl.vllm_refit:load_in_worker",
}
REFIT_PLUGIN = "nemo_jetrl_nemo_rl_refit"
# Async engines (vllm_cfg.async_engine): where the actor keeps the check's task, how long the
# driver polls for it.
_ASYNC_STATE = "_jetrl_engine_check"
ASYNC_TIMEOUT_S = 600
# Where NeMo-RL's vLLM actors get their Python (ray_actor_environment_registry / the image).
REBUILT = (
    "install nemo_jetrl into the venv NeMo-RL's vLLM workers run (the image links it; after "
    "NRL_FORCE_REBUILD_VENVS=true or a venv rebuilt by hand, pip install -e /opt/nemo-jetrl "
    "there again)"
)


class EngineNotProven(KernelNotInEffect):
    """A NeMo-RL vLLM engine does not run our kernel on every FP8 linear, or lacks our refit hook."""


def worker_status(worker: Any) -> dict[str, Any]:
    """In one vLLM worker (``collective_rpc``): its kernel report, refit hook and plugin facts;
    prints one line in the worker's log."""
    from importlib.metadata import entry_points

    from nemo_jetrl.backends.nemo_rl import vllm_refit
    from nemo_jetrl.backends.nemo_rl.kv_backends import fp8_kv_attention_impls
    from nemo_jetrl.vllm_patch.guard import PLUGIN_GROUP, layer_kernel_report
    from nemo_jetrl.vllm_patch.worker_ext import model_of

    model = model_of(worker)
    report = layer_kernel_report(model)
    handle = vllm_refit._PLUGIN_HANDLE
    report["refit_hook"] = (
        {"active": handle.active, "layout": handle.layout} if handle is not None else None
    )
    report["env"][vllm_refit.ENV_VAR] = os.environ.get(vllm_refit.ENV_VAR)
    report["entry_points"] = {
        ep.name: ep.value for ep in entry_points(group=PLUGIN_GROUP) if ep.name in ENTRY_POINTS
    }
    report["python"] = sys.executable
    report["fp8_kv_attention"] = fp8_kv_attention_impls(model)
    report["fp8_kv_query_quant"] = fp8_kv_attention_impls(model, fp8_queries=True)
    for name, info in report["layers"].items():  # experts this engine holds, for the line
        if info.get("moe"):
            info["experts"] = int(model.get_submodule(name).w13_weight.shape[0])
    hook = "installed" if handle is not None and handle.active else "NOT installed"
    print(
        f"nemo_jetrl: plugin loaded in vLLM worker pid {os.getpid()} ({sys.executable}): "
        f"{serves_text(served([report]))}, refit hook {hook}",
        flush=True,
    )
    return report


SERVED_KEYS = ("linears", "linears_ours", "expert_layers", "expert_layers_ours", "experts")


def served(reports: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """What the workers' block-FP8 layers are: linears and routed-expert layers (with the
    experts they hold), and how many of each run our kernel."""
    out = dict.fromkeys(SERVED_KEYS, 0)
    for rep in reports:
        for info in rep.get("layers", {}).values():
            kind = "expert_layers" if info.get("moe") else "linears"
            out[kind] += 1
            out[f"{kind}_ours"] += int(bool(info.get("ours")))
            out["experts"] += int(info.get("experts") or 0)
    return out


def serves_text(counts: Mapping[str, int]) -> str:
    """``kernel serves 8/8 FP8 linears`` (a dense model), ``... and 2/2 FP8 expert layers
    (8 experts)`` where the engine has routed experts."""
    text = f"kernel serves {counts['linears_ours']}/{counts['linears']} FP8 linears"
    if counts.get("expert_layers"):
        text += (
            f" and {counts['expert_layers_ours']}/{counts['expert_layers']} FP8 expert layers "
            f"({counts['experts']} experts)"
        )
    return text


def entry_point_problems(have: Mapping[str, str], python: str) -> list[str]:
    """Our entry points missing from (or stale in) the vLLM workers' Python ``python``."""
    return _entry_point_problems({"entry_points": dict(have), "python": python}, 0)


def _entry_point_problems(report: Mapping[str, Any], rank: int) -> list[str]:
    have = report.get("entry_points", {})
    out = []
    for name, target in ENTRY_POINTS.items():
        if name not in have:
            out.append(
                f"worker {rank}: the vllm.general_plugins entry point {name!r} is not installed "
                f"in this worker's Python ({report.get('python')}): {REBUILT}"
            )
        elif have[name] != target:
            out.append(
                f"worker {rank}: entry point {name!r} points to {have[name]!r}, not {target!r} "
                f"(a stale install): {REBUILT}"
            )
    return out


def _hook_problem(report: Mapping[str, Any], rank: int) -> str | None:
    from nemo_jetrl.backends.nemo_rl import vllm_refit

    hook = report.get("refit_hook")
    if hook and hook.get("active"):
        return None
    env = report.get("env", {})
    causes = []
    if not env.get(vllm_refit.ENV_VAR):
        causes.append(f"{vllm_refit.ENV_VAR} is not set in the worker")
    plugins = env.get("VLLM_PLUGINS")
    if plugins is not None and REFIT_PLUGIN not in plugins.split(","):
        causes.append(f"the worker has VLLM_PLUGINS={plugins!r} without {REFIT_PLUGIN!r}")
    if hook is not None:
        causes.append("it was installed and then replaced or reverted")
    why = "; ".join(causes) or f"the {REFIT_PLUGIN!r} plugin did not run in the worker"
    return (
        f"worker {rank}: our refit hook is not installed, so NeMo-RL's refit would quantize "
        f"weights with its own code and skip the parity check ({why})"
    )


def judge(
    reports: Sequence[Mapping[str, Any]], patch_json: str, hook_expected: bool
) -> dict[str, Any]:
    """The verdict on one engine's worker reports: raises EngineNotProven with every problem, or
    returns the counts and the log line."""
    from nemo_jetrl.vllm_patch.guard import kernel_problems
    from nemo_jetrl.vllm_patch.kernel import registered_kernel
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    settings = PatchSettings.from_json(patch_json)
    try:
        ours = registered_kernel()
    except ImportError:  # no vLLM in this process (the driver): the name is for messages only
        ours = None
    kernel_name = ours.__name__ if ours is not None else "nemo_jetrl's block-FP8 kernel"
    problems = []
    for rank, rep in enumerate(reports):
        problems += _entry_point_problems(rep, rank)
        if hook_expected and (p := _hook_problem(rep, rank)):
            problems.append(p)
        problems += kv_backend_problems(rep, rank)
    problems += kernel_problems(list(reports), settings, kernel_name)
    total = sum(len(r.get("layers", {})) for r in reports)
    good = sum(1 for r in reports for i in r.get("layers", {}).values() if i.get("ours"))
    if problems:
        raise EngineNotProven(
            "a NeMo-RL vLLM engine does not run nemo_jetrl's kernel and refit hook (its rollout "
            "would be off-policy); the run stops before its first step:\n  - "
            + "\n  - ".join(problems)
        )
    layouts = sorted({str((r.get("refit_hook") or {}).get("layout")) for r in reports})
    hook = f"refit hook installed ({', '.join(layouts)})" if hook_expected else "refit hook off"
    counts = served(reports)
    line = f"nemo_jetrl: plugin loaded in {len(reports)} vLLM worker(s); {serves_text(counts)}"
    line += f", {hook}"
    return {"workers": len(reports), "fp8_linears": total, "on_our_kernel": good,
            "served": counts, "line": line}  # fmt: skip


def check_in_generation_worker(actor: Any, patch_json: str, hook_expected: bool) -> dict[str, Any]:
    """In NeMo-RL's generation actor (``__ray_call__``): ask its engine's vLLM workers and judge.
    Returns ``judge``'s result ({"async": True} for an AsyncLLM: not checked)."""
    llm = getattr(actor, "llm", None)
    if llm is None:
        raise EngineNotProven(
            "NeMo-RL's vLLM generation worker has no engine yet (defer_model_load?): nothing to "
            "check; the check runs after grpo.setup"
        )
    if inspect.iscoroutinefunction(getattr(llm, "collective_rpc", None)):
        return _async_step(actor, llm, patch_json, hook_expected)
    result = judge(llm.collective_rpc(worker_status), patch_json, hook_expected)
    print(result["line"], flush=True)
    return result


def _engine_loop(llm: Any) -> Any:
    """The event loop vLLM's AsyncLLM runs on (its output handler's, or its engine client's
    output task's, which vLLM 0.20-0.32 keep in its ``resources``); None when neither has
    started."""
    core = getattr(llm, "engine_core", None)
    for task in (
        getattr(llm, "output_handler", None),
        getattr(getattr(core, "resources", None), "output_queue_task", None),
    ):
        get_loop = getattr(task, "get_loop", None)
        if get_loop is not None and not get_loop().is_closed():
            return get_loop()
    return None


def _async_step(actor: Any, llm: Any, patch_json: str, hook_expected: bool) -> dict[str, Any]:
    """vLLM's AsyncLLM (``vllm_cfg.async_engine``) answers ``collective_rpc`` only on its event
    loop. Ray (2.60) runs a sync method of an async actor, ``__ray_call__`` included, in a thread
    of its own: there the RPC is sent to AsyncLLM's loop and awaited from this thread. Where
    Ray runs it on the loop itself, the RPC becomes a task there and this answers
    ``{"pending": True}`` until a later call finds it done (the driver polls)."""
    import asyncio

    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is None:
        loop = _engine_loop(llm)
        if loop is None:
            return {"async": True}
        rpc = asyncio.run_coroutine_threadsafe(llm.collective_rpc(worker_status), loop)
        result = judge(rpc.result(timeout=ASYNC_TIMEOUT_S), patch_json, hook_expected)
        print(result["line"], flush=True)
        return result
    state = actor.__dict__.get(_ASYNC_STATE)
    if state is None:
        actor.__dict__[_ASYNC_STATE] = running.create_task(llm.collective_rpc(worker_status))
        return {"pending": True}
    if isinstance(state, dict):  # judged on an earlier poll
        return state
    if not state.done():
        return {"pending": True}
    del actor.__dict__[_ASYNC_STATE]  # a failure below is raised once; a new call starts over
    result = judge(state.result(), patch_json, hook_expected)
    print(result["line"], flush=True)
    actor.__dict__[_ASYNC_STATE] = result
    return result


def prove_generation_engines(
    policy_generation: Any,
    vllm_env: Mapping[str, str],
    logger: Any = None,
    *,
    get: Any = None,
) -> dict[str, Any] | None:
    """In the driver, after ``grpo.setup``: run `check_in_generation_worker` in every generation
    actor (the leader of each engine), print the line and log the metrics at step 0. Returns the
    totals (None when the recipe's rollout is not ours). ``get``: ``ray.get`` (a test's stand-in).
    """
    from nemo_jetrl.backends.nemo_rl.translate import VLLM_PATCH_ENV
    from nemo_jetrl.backends.nemo_rl.vllm_refit import ENV_VAR as HOOK_ENV

    patch_json = vllm_env.get(VLLM_PATCH_ENV)
    if patch_json is None:
        return None
    hook = HOOK_ENV in vllm_env
    if get is None:
        import ray

        get = ray.get
    deadline = time.monotonic() + ASYNC_TIMEOUT_S
    while True:
        # Keywords only: NeMo-RL's RayWorkerGroup.run_all_workers_single_data asserts that no
        # positional argument follows the method name (it ray.put()s each keyword's value);
        # Ray's __ray_call__(self, fn, *args, **kwargs) then calls fn(actor, **kwargs).
        futures = policy_generation.worker_group.run_all_workers_single_data(
            "__ray_call__",
            fn=check_in_generation_worker,
            patch_json=patch_json,
            hook_expected=hook,
            run_rank_0_only_axes=["tensor_parallel", "pipeline_parallel"],
        )
        try:
            results = get(futures)
        except Exception as exc:  # a RayTaskError carrying the actor's exception
            raise EngineNotProven(_remote_reason(exc)) from None
        if not any(r.get("pending") for r in results):
            break
        if time.monotonic() > deadline:  # an async engine's RPC never came back
            raise EngineNotProven(
                f"NeMo-RL's async vLLM engines did not answer nemo_jetrl's check within "
                f"{ASYNC_TIMEOUT_S} s"
            )
        time.sleep(0.2)
    if any(r.get("async") for r in results):
        print(
            "nemo_jetrl: engine check NOT run: policy.generation.vllm_cfg.async_engine=true and "
            "vLLM's AsyncLLM has no running event loop to ask on yet",
            flush=True,
        )
        return {"async": True}
    total = sum(r["fp8_linears"] for r in results)
    good = sum(r["on_our_kernel"] for r in results)
    workers = sum(r["workers"] for r in results)
    hook_text = "refit hook installed" if hook else "refit hook off (jetrl.refit_hook: false)"
    counts = dict.fromkeys(SERVED_KEYS, 0)
    for r in results:  # (a result without "served": every layer a linear)
        got = r.get("served") or {"linears": r["fp8_linears"], "linears_ours": r["on_our_kernel"]}
        for k in SERVED_KEYS:
            counts[k] += int(got.get(k, 0))
    print(
        f"nemo_jetrl: plugin loaded in {workers} vLLM worker(s) of {len(results)} engine(s); "
        f"{serves_text(counts)}, {hook_text}",
        flush=True,
    )
    metrics = {FRACTION_METRIC: good / total if total else 1.0, HOOK_METRIC: float(hook)}
    if logger is not None:
        logger.log_metrics(metrics, 0, prefix="")
    return {"engines": len(results), "workers": workers, "fp8_linears": total,
            "on_our_kernel": good, **metrics}  # fmt: skip


def _remote_reason(exc: BaseException) -> str:
    """The actor's own error, unwrapped from Ray's (a missing nemo_jetrl explained)."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, EngineNotProven):
        return str(cause)
    if isinstance(cause, ModuleNotFoundError) and (cause.name or "").startswith("nemo_jetrl"):
        return (
            "nemo_jetrl is not importable in NeMo-RL's vLLM generation worker, so neither our "
            f"kernel nor our refit hook can be in it ({cause}): {REBUILT}"
        )
    return (
        "could not check NeMo-RL's vLLM generation workers for nemo_jetrl's kernel and refit "
        f"hook ({type(cause).__name__}: {cause})"
    )
