"""A validated config + Recipe -> the NeMo-RL master config and the worker plumbing to run it.

Targets NeMo-RL v0.7.0 (tag ``v0.7.0``, commit 81aa43dda4765b0429cf31dab44441e4e4383911, the
NGC image ``nvcr.io/nvidia/nemo-rl:v0.7.0``). What NeMo-RL reads, and how our pieces reach its
Ray workers (all read from that source, file paths relative to its repository):

- ``policy.megatron_cfg.fp8_cfg.{enabled,fp8,fp8_recipe,fp8_param}`` -> Megatron-Bridge's model
  provider (``nemo_rl/models/megatron/setup.py``). NeMo-RL has no key for Megatron's
  ``first_last_layers_bf16``: training-side BF16 first/last layers are refused here.
- ``policy.megatron_cfg.env_vars`` -> ``runtime_env.env_vars`` of every Megatron policy worker
  (``lm_policy.Policy`` -> ``RayWorkerGroup``), set before the worker process imports anything:
  this is how ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` is in place before TE is imported, and how
  the worker extension receives the recipe (``NEMO_JETRL_RECIPE``, JSON).
- ``policy.generation.vllm_cfg.env_vars`` -> env of the vLLM generation workers *and* vLLM's own
  non-leader workers (``vllm_generation.py``). vLLM loads the ``vllm.general_plugins`` entry point
  of this package in each of its processes; the plugin applies our vLLM patch only when
  ``NEMO_JETRL_VLLM_PATCH`` (the patch settings, JSON) is set (``nemo_jetrl/vllm_patch/plugin.py``),
  and a second entry point hooks NeMo-RL's refit loader when ``NEMO_JETRL_NRL_REFIT`` is set
  (``vllm_refit.py``: our weight quantizer and the parity check; set unless
  ``jetrl.refit_hook: false``, parity per ``jetrl.refit_parity_check``). That both ran is
  proven at engine start (``engine_check.py``); a non-``auto`` ``linear_backend`` in
  ``policy.generation.vllm_kwargs`` is refused here (the guard's ``engine_arg_problems``).
  (``vllm_kwargs`` cannot carry a worker extension: NeMo-RL passes its own
  ``worker_extension_cls`` to ``vllm.LLM`` next to ``**vllm_kwargs``.)
- The Megatron policy worker class: ``grpo.setup(..., policy_factory=...)`` builds the policy with
  our factory, which passes ``worker_extension_cls_fqn`` to ``Policy`` (a subclass of
  ``MegatronPolicyWorkerImpl``, see ``worker.py``). Ray actors need a Python environment
  registered in ``ACTOR_ENVIRONMENT_REGISTRY``; we register ours, by its Python path, with the
  same executable as the stock ``MegatronPolicyWorker`` (an explicit, revertible call; no venv
  link: ``venvs.py``).
- KV scales: grpo.py calls ``policy.calibrate_qkv_fp8_scales(data, include_q=True)`` when
  ``kv_cache_dtype`` is fp8 and ships ``result["layers"]`` with the refit; our worker overrides
  that method (masking, refusal of invalid scales, our settings).
- Run identity: the ``jetrl:`` section itself is not NeMo-RL's, so only ``{"recipe": <the
  recipe's name>, "run_name": <jetrl.run_name>}`` goes on as the master config's ``jetrl`` key
  (`run_identity`). NeMo-RL's ``MasterConfig`` keeps extra keys (``extra="allow"``) and
  ``grpo.setup`` logs ``master_config.model_dump()`` with ``logger.log_hyperparams`` (TensorBoard:
  ``add_hparams`` of the flattened config), where ``jetrl compare`` reads ``jetrl.run_name`` /
  ``jetrl.recipe`` to label the run (``runs/logs.py``).
- Metrics: grpo.py sums every loss-function metric over micro-batches; our loss wrapper adds
  additive ``jetrl/mismatch/*`` contributions, and a logger proxy writes them without the
  ``train/`` prefix, as the local backend does (``metrics.py``).

Everything here is plain Python (no NeMo-RL import), so it is unit-tested on CPU.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nemo_jetrl.backends.nemo_rl.policy_env import (
    ALLOW_OFF_POLICY_ENV,
    HF_IN_PROJ_SPLIT_ENV,
    RECIPE_ENV,
    recipe_to_json,
)
from nemo_jetrl.backends.nemo_rl.refit_rules import PP_KEY, TRANSPORT_KEY, refit_problems
from nemo_jetrl.backends.nemo_rl.tree_rules import TreeFacts, tree_problems
from nemo_jetrl.megatron.config import (
    MegatronFp8Settings,
    MegatronRecipeError,
    megatron_fp8_settings,
)
from nemo_jetrl.recipe import Recipe

NEMO_RL_VERSION = "0.7.0"
NEMO_RL_COMMIT = "81aa43dda4765b0429cf31dab44441e4e4383911"
NEMO_RL_IMAGE = "nvcr.io/nvidia/nemo-rl:v0.7.0"
STOCK_POLICY_WORKER = "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker"
POLICY_WORKER_FQN = "nemo_jetrl.backends.nemo_rl.worker.JetrlMegatronPolicyWorker"
VLLM_PATCH_ENV = "NEMO_JETRL_VLLM_PATCH"
DEEP_GEMM_E8M0_ENV = "VLLM_USE_DEEP_GEMM_E8M0"
"""vLLM's switch for re-quantizing block-FP8 weights to UE8M0 scales at load (default on)."""
# The master config's key for the run's identity (logged by NeMo-RL as hparams ``jetrl.*``).
IDENTITY_KEY = "jetrl"


class TranslationError(ValueError):
    """Every reason a config cannot run on NeMo-RL, each with its YAML key."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__(
            "the config cannot run on the NeMo-RL backend:\n"
            + "\n".join(f"  - {key}: {msg}" for key, msg in problems)
        )


@dataclass(frozen=True)
class WorkerSetup:
    """How our code becomes active inside NeMo-RL's Ray workers."""

    # Policy worker class passed to Policy(worker_extension_cls_fqn=...).
    policy_worker_fqn: str = POLICY_WORKER_FQN
    # Env vars every Megatron policy worker starts with (already merged into the config).
    policy_env: Mapping[str, str] = field(default_factory=dict)
    # Env vars of the vLLM workers (already merged into the config).
    vllm_env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NemoRlPlan:
    """The NeMo-RL master config (plain containers) plus the worker plumbing."""

    master_config: dict[str, Any]
    workers: WorkerSetup
    recipe: Recipe


def _get(d: Mapping[str, Any], path: str, default: Any = None) -> Any:
    cur: Any = d
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return default
        cur = cur[part]
    return cur


def _set(d: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    cur = d
    for part in parts[:-1]:
        nxt = cur.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            cur[part] = nxt
        cur = nxt
    cur[parts[-1]] = value


def _vllm_patch_json(recipe: Recipe, num_layers: int) -> str:
    from nemo_jetrl.vllm_patch.settings import settings_from_recipe

    s = settings_from_recipe(recipe, num_layers=num_layers)
    want_kv = "fp8" if recipe.kv_fp8 else "auto"
    if s.kv_cache_dtype != want_kv:
        s = dataclasses.replace(s, kv_cache_dtype=want_kv)
    return s.to_json()


def translate(
    config: Mapping[str, Any],
    recipe: Recipe,
    *,
    num_layers: int,
    tree: TreeFacts | None = None,
    hf_in_proj_split: bool | None = None,
) -> NemoRlPlan:
    """NeMo-RL master config and worker setup for ``recipe``; TranslationError lists all problems.

    ``config`` is the resolved config as plain containers (``OmegaConf.to_container``);
    ``num_layers`` the model's decoder layer count; ``tree`` what the NeMo-RL tree the run
    imports does (`tree_rules.read_tree`; None: unknown, its rules are skipped);
    ``hf_in_proj_split`` the model's gated delta net split (`arch.hybrid.HybridSpec.split_proj`;
    None: none or not read), passed to the policy workers. The input is not modified.
    """
    cfg = copy.deepcopy(dict(config))
    cfg.pop("jetrl", None)  # ours; NeMo-RL gets only the run's identity (below)
    cfg[IDENTITY_KEY] = run_identity(config, recipe)

    problems = _backend_problems(cfg) + _bf16_layer_problems(recipe)
    settings = _megatron_settings(cfg, recipe, num_layers, problems)
    problems += _kv_problems(cfg, recipe)
    patch_json = _patch_json_or_problem(cfg, recipe, num_layers, problems)
    hooked = patch_json is not None and _get(config, "jetrl.refit_hook", True) is not False
    problems += tree_problems(tree, recipe, num_layers=num_layers, hooked=hooked)
    if hooked:
        problems += refit_problems(
            transport=_get(config, TRANSPORT_KEY),
            pp=_get(config, PP_KEY, 1),
            parity=_get(config, "jetrl.refit_parity_check", True) is not False,
            rollback=_get(config, "jetrl.refit_rollback", True) is not False,
        )
    if problems:
        raise TranslationError(problems)
    assert settings is not None

    _set_fp8_cfg(cfg, recipe.train.fp8_linears, settings)
    policy_env = {RECIPE_ENV: recipe_to_json(recipe), **settings.env_vars}
    if _get(config, "jetrl.allow_off_policy", False) is True:
        policy_env[ALLOW_OFF_POLICY_ENV] = "1"
    if hf_in_proj_split is not None:
        policy_env[HF_IN_PROJ_SPLIT_ENV] = "1" if hf_in_proj_split else "0"
    _merge_env(cfg, "policy.megatron_cfg.env_vars", policy_env)

    from nemo_jetrl.config import vllm_cfg_for

    precision = _get(cfg, "policy.generation.vllm_cfg.precision", "bfloat16")
    for k, v in vllm_cfg_for(recipe, unquantized_precision=precision).items():
        _set(cfg, f"policy.generation.vllm_cfg.{k}", v)
    vllm_env = _vllm_env(config, patch_json)
    _merge_env(cfg, "policy.generation.vllm_cfg.env_vars", vllm_env)
    if patch_json is not None:
        from nemo_jetrl.vllm_patch.engine_args import settings_cache_key

        extra = _get(cfg, "policy.generation.vllm_kwargs.additional_config", None) or {}
        _set(cfg, "policy.generation.vllm_kwargs.additional_config",
             {**extra, **settings_cache_key(patch_json)})  # fmt: skip

    workers = WorkerSetup(policy_env=policy_env, vllm_env=vllm_env)
    return NemoRlPlan(master_config=cfg, workers=workers, recipe=recipe)


def run_identity(config: Mapping[str, Any], recipe: Recipe) -> dict[str, str]:
    """What NeMo-RL logs as hyperparameters to name the run: the recipe that runs (its name as
    the NeMo-RL keys make it, e.g. ``jetrl``) and ``jetrl.run_name`` when the user chose one."""
    out = {"recipe": recipe.name}
    name = _get(config, "jetrl.run_name")
    if isinstance(name, str) and name.strip():
        out["run_name"] = name.strip()
    return out


def _backend_problems(cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Megatron training and vLLM generation: the only NeMo-RL backends our pieces reach."""
    problems: list[tuple[str, str]] = []
    if _get(cfg, "policy.megatron_cfg.enabled") is not True:
        problems.append(
            (
                "policy.megatron_cfg.enabled",
                "the nemo-rl backend trains with Megatron-Core: set it to true",
            )
        )
    backend = _get(cfg, "policy.generation.backend", "vllm")
    if backend != "vllm":
        problems.append(
            ("policy.generation.backend", f"{backend!r}: the vLLM patch and KV scales need 'vllm'")
        )
    return problems


def _bf16_layer_problems(recipe: Recipe) -> list[tuple[str, str]]:
    """Training-side BF16 first/last layers, which NeMo-RL's fp8_cfg cannot express."""
    problems: list[tuple[str, str]] = []
    t = recipe.train
    for which, n in (("first", t.bf16_first_layers), ("last", t.bf16_last_layers)):
        if n:
            problems.append(
                (
                    f"jetrl.train_num_{which}_layers_in_bf16",
                    f"{n}: NeMo-RL {NEMO_RL_VERSION} has no key for Megatron's first_last_layers_bf16 "
                    "(its fp8_cfg passes only fp8, fp8_recipe, fp8_param); set 0 and keep the rollout's "
                    "BF16 layers at 0 too, or use the local backend",
                )
            )
    return problems


def _megatron_settings(
    cfg: Mapping[str, Any], recipe: Recipe, num_layers: int, problems: list[tuple[str, str]]
) -> MegatronFp8Settings | None:
    """Megatron's FP8 settings for the recipe (BF16 edges already refused); None, with the
    reason appended to ``problems``, when Megatron cannot run it."""
    t = recipe.train
    pp = int(_get(cfg, "policy.megatron_cfg.pipeline_model_parallel_size", 1) or 1)
    try:
        return megatron_fp8_settings(
            recipe.with_(train=t.with_(bf16_first_layers=0, bf16_last_layers=0)),
            num_layers=num_layers,
            pipeline_parallel_size=pp,
        )
    except MegatronRecipeError as exc:
        problems.append(("policy.megatron_cfg.fp8_cfg", str(exc)))
        return None


def _kv_problems(cfg: Mapping[str, Any], recipe: Recipe) -> list[tuple[str, str]]:
    """FP8 KV-cache settings NeMo-RL's calibration, refit and training step cannot honour."""
    if not recipe.kv_fp8:
        return []
    calib = recipe.kv_calibration
    graphs = _get(cfg, "policy.megatron_cfg.cuda_graph_impl", "none")
    scope = _get(cfg, "policy.megatron_cfg.cuda_graph_modules") or []  # main: [] = whole layers
    scope = [scope] if isinstance(scope, str) else list(scope)
    # Megatron replays a captured attention without running Python: our pre-hook would keep
    # the KV scales of the capture while recalibration moves the rollout's
    frozen = graphs not in (None, "none") and (
        graphs == "full_iteration" or "attn" in scope or not scope
    )
    rules = [
        (calib.data_fraction != 1.0, "jetrl.kv_calibration.data_fraction",
         f"{calib.data_fraction}: NeMo-RL hands its calibration every sequence of the step (each "
         "data-parallel rank its shard), and our worker keeps its micro-batch plan; set 1.0 (the "
         "local backend samples a fraction)"),
        (recipe.onpolicy_kv and frozen, "policy.megatron_cfg.cuda_graph_impl",
         f"{graphs!r}: training CUDA graphs that capture attention freeze the on-policy KV scales "
         "at capture; set it to 'none', or keep attn out of policy.megatron_cfg.cuda_graph_modules"),
        (recipe.kv_scale_source != "trainer_calibrated", "jetrl.kv_scale_source",
         f"{recipe.kv_scale_source!r}: with an FP8 KV cache NeMo-RL always recalibrates Q/K/V "
         "scales on the trainer and sends them at refit; use trainer_calibrated"),
        (calib.mask == "response", "jetrl.kv_calibration.mask",
         "'response': NeMo-RL's calibration batch carries input_ids and input_lengths only (no "
         "response mask); use prompt_and_response (padding excluded) or none"),
    ]  # fmt: skip
    return [(key, why) for bad, key, why in rules if bad]


def _patch_json_or_problem(
    cfg: Mapping[str, Any], recipe: Recipe, num_layers: int, problems: list[tuple[str, str]]
) -> str | None:
    """The vLLM patch settings (JSON) when the rollout quantizes with ours, else None; an
    invalid patch is appended to ``problems``."""
    ro = recipe.rollout
    if not (ro.fp8_linears and ro.quantizer == "jetrl"):
        return None
    from nemo_jetrl.vllm_patch.guard import engine_arg_problems

    # vLLM kwargs that would take block-FP8 linears away from our kernel (the guard's rule, as
    # the local engine applies it): refused before any worker starts, naming the key.
    vllm_kwargs = _get(cfg, "policy.generation.vllm_kwargs", {}) or {}
    for msg in engine_arg_problems(vllm_kwargs if isinstance(vllm_kwargs, Mapping) else {}):
        key, _, why = msg.partition(": ")  # "<key>: you set ..."
        problems.append((f"policy.generation.vllm_kwargs.{key}", why))
    extra = vllm_kwargs.get("additional_config") if isinstance(vllm_kwargs, Mapping) else None
    if extra is not None and not isinstance(extra, Mapping):
        problems.append((
            "policy.generation.vllm_kwargs.additional_config",
            "must be a dict: nemo_jetrl adds its kernel settings to it (vLLM hashes it into "
            "its compile-cache key)",
        ))  # fmt: skip
    try:
        return _vllm_patch_json(recipe, num_layers)
    except ValueError as exc:
        problems.append(("jetrl.vllm_patch", str(exc)))
        return None


def _set_fp8_cfg(cfg: dict[str, Any], fp8_linears: bool, settings: MegatronFp8Settings) -> None:
    """Write ``policy.megatron_cfg.fp8_cfg`` from the Megatron settings (other keys kept)."""
    fp8_cfg = dict(_get(cfg, "policy.megatron_cfg.fp8_cfg", {}) or {})
    fp8_cfg["enabled"] = fp8_linears
    if fp8_linears:
        fp8_cfg.update(
            fp8=settings.transformer_config["fp8"],
            fp8_recipe=settings.transformer_config["fp8_recipe"],
            fp8_param=settings.transformer_config["fp8_param"],
        )
    _set(cfg, "policy.megatron_cfg.fp8_cfg", fp8_cfg)


def _merge_env(cfg: dict[str, Any], path: str, extra: Mapping[str, str]) -> None:
    """Add ``extra`` to the env-var mapping at ``path`` (ours win), all values as strings."""
    env = dict(_get(cfg, path, {}) or {})
    env.update(extra)
    _set(cfg, path, {str(k): str(v) for k, v in env.items()})


def _vllm_env(config: Mapping[str, Any], patch_json: str | None) -> dict[str, str]:
    """Env vars that switch on our vLLM patch and, unless ``jetrl.refit_hook: false``, the
    refit hook in the vLLM workers."""
    vllm_env: dict[str, str] = {}
    if patch_json is not None:
        from nemo_jetrl.backends.nemo_rl.vllm_refit import refit_hook_env

        vllm_env[VLLM_PATCH_ENV] = patch_json
        # NeMo-RL's FP8 weight loading (precision: fp8) ends in DeepGEMM's post-processing on
        # Hopper/Blackwell, which with vLLM's default E8M0=1 re-quantizes every FP8 weight in
        # place to power-of-two UE8M0 scales: the engine would not hold the trainer's weights.
        # A value the config sets is left for `worker_env.worker_env_problems` to judge.
        user = _get(config, "policy.generation.vllm_cfg.env_vars", None) or {}
        if DEEP_GEMM_E8M0_ENV not in user:
            vllm_env[DEEP_GEMM_E8M0_ENV] = "0"
        # NeMo-RL's vLLM refit then quantizes with ours and checks parity (vllm_refit.py).
        if _get(config, "jetrl.refit_hook", True) is not False:
            parity = _get(config, "jetrl.refit_parity_check", True)
            rollback = _get(config, "jetrl.refit_rollback", True)
            host = _get(config, "policy.generation.colocated.enabled", True) is not False
            vllm_env.update(refit_hook_env(parity is not False, rollback is not False, host))
    return vllm_env
