"""The guard: no engine runs a block-FP8 linear with anything but our kernel, silently or not.

vLLM picks a block-FP8 linear layer's kernel per process from its registry, and several ordinary
settings make it pick another one without a word (the rollout then quantizes activations with
vLLM's own formula: off-policy). Each is refused, naming the setting:

* **before start**, in the driver (``apply_patches`` calls ``check_before_start``):
  our ``vllm.general_plugins`` entry point missing or not loadable in this Python environment
  (vLLM's worker processes would start without our kernel; vLLM only *logs* a plugin that fails
  to load); ``VLLM_PLUGINS`` set without our plugin's name; ``VLLM_DISABLED_KERNELS`` naming our
  kernel class. Both variables are read with vLLM's own parser (``compat.vllm_env``).
* **in the engine kwargs** (``build_engine_kwargs`` calls ``engine_arg_problems``): a
  ``linear_backend`` (vLLM >= 0.32, ``--linear-backend``) or ``kernel_config.linear_backend`` /
  ``kernel_config.linear_backend_per_quant[fp8_block_w8a8]`` other than ``auto``. vLLM's
  ``_resolve_backend_kernels`` keeps only that backend's kernels when it has one for the platform
  (``cutlass`` on CUDA: our class is dropped) and falls back to the full list otherwise; which
  one happens depends on the platform and the release, so every value but ``auto`` is refused.
* **after start** (``verify_engine_kernels``, called by ``VllmRolloutEngine``; call it yourself
  after ``vllm.LLM(...)``): every worker reports, through our worker extension
  (``jetrl_kernel_report``), the kernel of each block-FP8 linear layer and routed-experts layer
  (``experts.moe_layer_report``: vLLM's ``Fp8MoEMethod`` with any of its expert kernels is not
  ours), and an MoE router (``mlp.gate``) that is block-FP8; any layer whose kernel is
  not ours with the engine's settings, or no block-FP8 layer at all when the recipe runs FP8,
  shuts the engine down and raises ``KernelNotInEffect`` naming the layers and the reason
  (with the worker's own ``VLLM_DISABLED_KERNELS``/``VLLM_PLUGINS``/patch variable, which can
  differ from the driver's, e.g. under Ray). This also catches what no setting shows: the plugin
  not installed in the workers' environment, or another library replacing the kernel.

Errors are ``UserError``s: the ``jetrl`` CLI prints them without a traceback (exit 2).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from nemo_jetrl.errors import UserError
from nemo_jetrl.vllm_patch import compat
from nemo_jetrl.vllm_patch.settings import ENV_VAR, PatchSettings
from nemo_jetrl.vllm_patch.shutdown import shutdown_engine

# Our entry point, as pyproject.toml declares it ([project.entry-points."vllm.general_plugins"]).
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "nemo_jetrl"
PLUGIN_TARGET = "nemo_jetrl.vllm_patch.plugin:load_in_worker"
# MoE routers (Qwen-style ``mlp.gate``, Mixtral's ``block_sparse_moe.gate``): BF16 on both
# sides, never block-FP8.
ROUTER_SUFFIXES = (".mlp.gate", ".block_sparse_moe.gate")
# How many layer names an error lists before it says "and N more".
MAX_NAMED = 12


class KernelGuardError(UserError, RuntimeError):
    """A setting would make vLLM run block-FP8 linears without our kernel; refused before start."""


class KernelNotInEffect(KernelGuardError):
    """A started engine runs block-FP8 linears with another kernel; it was shut down."""


def _plural(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMED])
    return shown + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")


# -- before start ----------------------------------------------------------------------------


def plugin_problems(entry_points: Iterable[Any] | None = None) -> list[str]:
    """Why vLLM's processes would not load our plugin from this environment (empty: they will).

    ``entry_points``: the ``vllm.general_plugins`` entry points (default: this environment's).
    """
    if entry_points is None:
        from importlib.metadata import entry_points as installed

        entry_points = installed(group=PLUGIN_GROUP)
    ours = [ep for ep in entry_points if ep.name == PLUGIN_NAME]
    install = (
        "install nemo_jetrl into the Python environment vLLM's workers run (pip install -e . "
        "in the repository, or the Docker image), which registers it"
    )
    if not ours:
        return [
            f"the {PLUGIN_GROUP} entry point {PLUGIN_NAME!r} is not installed here, so vLLM's "
            f"engine and worker processes would start without our kernel: {install}"
        ]
    problems = []
    for ep in ours:
        if ep.value != PLUGIN_TARGET:
            problems.append(
                f"the {PLUGIN_GROUP} entry point {PLUGIN_NAME!r} points to {ep.value!r}, not "
                f"{PLUGIN_TARGET!r} (a stale or foreign install): {install}"
            )
            continue
        try:
            ep.load()
        except Exception as exc:  # vLLM itself only logs this and starts without the plugin
            problems.append(
                f"the {PLUGIN_GROUP} entry point {PLUGIN_NAME!r} ({ep.value}) fails to load "
                f"({type(exc).__name__}: {exc}); vLLM would log it and start without our kernel"
            )
    return problems


def env_problems(kernel_name: str, plugins: list[str] | None, disabled: list[str]) -> list[str]:
    """What ``VLLM_PLUGINS`` (None: unset) and ``VLLM_DISABLED_KERNELS`` (as vLLM parses them)
    do to our plugin and kernel."""
    problems = []
    if plugins is not None and PLUGIN_NAME not in plugins:
        problems.append(
            f"VLLM_PLUGINS={','.join(plugins)!r} does not list {PLUGIN_NAME!r}, so vLLM's "
            f"processes skip our plugin: add {PLUGIN_NAME} to VLLM_PLUGINS or unset it"
        )
    if kernel_name in disabled:
        problems.append(
            f"VLLM_DISABLED_KERNELS={','.join(disabled)!r} names {kernel_name}, so vLLM would "
            f"pick its own block-FP8 kernel (its own activation quantizer: off-policy): remove "
            f"{kernel_name} from VLLM_DISABLED_KERNELS"
        )
    return problems


def check_before_start(settings: PatchSettings, kernel_name: str) -> None:
    """Raise KernelGuardError listing every setting of this environment that would keep our
    kernel out of an engine started now (nothing to check for a BF16 rollout)."""
    if not settings.fp8_weights:
        return
    problems = plugin_problems() + env_problems(
        kernel_name, compat.vllm_env("VLLM_PLUGINS"), compat.vllm_env("VLLM_DISABLED_KERNELS")
    )
    if problems:
        raise KernelGuardError(
            "the nemo_jetrl vLLM patch refuses this environment (vLLM would run block-FP8 "
            "linears without our kernel, i.e. off-policy):\n  - " + "\n  - ".join(problems)
        )


def _normalized_backend(value: Any) -> Any:
    # vLLM normalizes backend names the same way (KernelConfig's field validator).
    return value.lower().replace("-", "_") if isinstance(value, str) else value


def engine_arg_problems(user_kwargs: Mapping[str, Any]) -> list[str]:
    """User engine kwargs that would take block-FP8 linears away from our kernel."""
    problems = []
    why = (
        "vLLM's _resolve_backend_kernels would keep only that backend's block-FP8 kernels where "
        "it has one (dropping ours); leave it 'auto' (our kernel is first in the registry)"
    )
    found = [("linear_backend", user_kwargs.get("linear_backend"))]
    kc = user_kwargs.get("kernel_config")
    if kc is not None:
        get = kc.get if isinstance(kc, Mapping) else lambda k: getattr(kc, k, None)
        found.append(("kernel_config.linear_backend", get("linear_backend")))
        per_quant = get("linear_backend_per_quant")
        key = compat.FP8_BLOCK_QUANT_KEY
        if isinstance(per_quant, Mapping):
            found.append((f"kernel_config.linear_backend_per_quant.{key}", per_quant.get(key)))
    for name, value in found:
        if value is not None and _normalized_backend(value) != "auto":
            problems.append(f"{name}: you set {value!r}, the recipe requires 'auto' ({why})")
    return problems


# -- after start -----------------------------------------------------------------------------


def _text(value: Any) -> str | None:
    return None if value is None else str(value)  # plain data through collective_rpc


def layer_kernel_report(model: Any) -> dict[str, Any]:
    """What a worker's model runs (called in the worker by ``jetrl_kernel_report``).

    ``layers``: for every block-FP8 linear (a module with a ``quant_method`` and a
    ``weight_scale_inv`` tensor) its kernel class name, whether it is ours, our kernel's settings
    JSON, and the GEMM backend it chose (``jetrl_gemm_backend``, where the kernel exposes one);
    ``registered``: our kernel is in this process's registry; ``env``: the variables that decide
    it, as this process sees them.
    """
    from nemo_jetrl.vllm_patch.experts import moe_layer_report
    from nemo_jetrl.vllm_patch.kernel import MARKER, registered_kernel

    layers = {}
    for name, module in model.named_modules():
        if (moe := moe_layer_report(module)) is not None:  # block-FP8 routed experts
            layers[name] = moe
            continue
        qm = getattr(module, "quant_method", None)
        if qm is None or not hasattr(module, "weight_scale_inv"):
            continue
        kernel = getattr(qm, "fp8_linear", None)
        owner = kernel if kernel is not None else qm
        layers[name] = {
            "kernel": type(owner).__name__,
            "ours": bool(getattr(type(owner), MARKER, False)),
            "settings": getattr(owner, "jetrl_settings_json", None),
            "gemm_backend": _text(getattr(owner, "jetrl_gemm_backend", None)),
        }
    env = {k: os.environ.get(k) for k in ("VLLM_PLUGINS", "VLLM_DISABLED_KERNELS", ENV_VAR)}
    return {"layers": layers, "registered": registered_kernel() is not None, "env": env}


def _worker_reason(report: Mapping[str, Any], kernel_name: str) -> str:
    env = report.get("env", {})
    causes = []
    if not env.get(ENV_VAR):
        causes.append(f"{ENV_VAR} is not set in the worker (apply_patches was not in effect)")
    if not report.get("registered"):
        causes.append(
            "our kernel is not registered in the worker (plugin not installed or skipped there)"
        )
    disabled = (env.get("VLLM_DISABLED_KERNELS") or "").split(",")
    if kernel_name in disabled:
        causes.append(f"the worker has VLLM_DISABLED_KERNELS={env['VLLM_DISABLED_KERNELS']!r}")
    plugins = env.get("VLLM_PLUGINS")
    if plugins is not None and PLUGIN_NAME not in plugins.split(","):
        causes.append(f"the worker has VLLM_PLUGINS={plugins!r}")
    return "; ".join(causes) or "a kernel chosen or replaced outside the registry"


def kernel_problems(
    reports: list[Mapping[str, Any]], settings: PatchSettings, kernel_name: str
) -> list[str]:
    """Every worker's layers that do not run our kernel with ``settings``, with the reason."""
    if not settings.fp8_weights:
        return []
    want = settings.to_json()
    # With every decoder layer FP8 there must be block-FP8 linears; a recipe that keeps whole
    # layers in BF16 may (in a tiny model) keep them all.
    fp8_expected = not any(".layers." in m for m in settings.modules_to_not_convert)
    problems = []
    for rank, report in enumerate(reports):
        layers = report.get("layers", {})
        if not layers and fp8_expected:
            problems.append(
                f"worker {rank}: no block-FP8 linear layer at all (the recipe runs FP8: the "
                "engine did not take the quantization/hf_overrides from build_engine_kwargs)"
            )
            continue
        by_kernel: dict[str, list[str]] = {}
        for name, info in layers.items():
            if name.endswith(ROUTER_SUFFIXES):
                by_kernel.setdefault("FP8 (a router must stay BF16)", []).append(name)
            elif not info.get("ours"):
                by_kernel.setdefault(str(info.get("kernel")), []).append(name)
            elif info.get("settings") != want:
                by_kernel.setdefault(f"{kernel_name} with other settings", []).append(name)
        for kernel, names in sorted(by_kernel.items()):
            problems.append(
                f"worker {rank}: {len(names)} of {len(layers)} block-FP8 linears run {kernel}, "
                f"not {kernel_name}: {_plural(sorted(names))} (likely cause: "
                f"{_worker_reason(report, kernel_name)})"
            )
    return problems


def verify_engine_kernels(llm: Any, settings: PatchSettings) -> dict[str, Any]:
    """Confirm, by asking every worker, that each block-FP8 linear runs our kernel with
    ``settings``. Returns worker 0's report. Otherwise shuts the engine down and raises
    KernelNotInEffect naming the layers and the reason."""
    if not settings.fp8_weights:
        return {}
    from nemo_jetrl.vllm_patch.kernel import registered_kernel

    ours = registered_kernel()
    kernel_name = (
        ours.__name__
        if ours is not None
        else "our kernel (not registered in this process: apply_patches is not in effect)"
    )
    reports = llm.collective_rpc("jetrl_kernel_report")
    problems = kernel_problems(reports, settings, kernel_name)
    if problems:
        shutdown_engine(llm)
        raise KernelNotInEffect(
            "the vLLM engine does not run our kernel on every block-FP8 linear (its rollout "
            "would be off-policy); it was shut down:\n  - " + "\n  - ".join(problems)
        )
    return reports[0]
