"""``jetrl train --backend nemo-rl``: run a config through NeMo-RL's GRPO (v0.7.0).

Steps, in order (each user error ends the run with a message, no traceback):

1. load the NeMo-RL-shaped YAML with overrides and validate it (`nemo_jetrl.config`);
2. check the precision flow; an off-policy recipe is refused unless ``jetrl.allow_off_policy``;
3. translate into NeMo-RL keys and worker plumbing (`nemo_rl_translate.translate`);
4. check that NeMo-RL (and Ray) import; if not, say what is missing and how to get it (the
   Docker image built from docker/Dockerfile);
5. before Ray starts (`driver.prepare_master`): the trainer kind (async GRPO, or a refusal of
   the TransferQueue data plane), every path the config names made absolute or refused by key
   (`paths.py`), the workers' venvs (`venvs.py`), the vLLM version in the vLLM workers' venv;
6. launch as NeMo-RL's ``examples/run_grpo.py`` does (``init_ray``, tokenizer,
   ``configure_generation_config``, ``setup_response_data``, ``grpo.setup`` with our
   ``policy_factory``, ``grpo_train`` or ``async_grpo_train``), with our policy worker
   registered, the loss function wrapped to add mismatch metrics and the logger proxied
   (`driver.py`, `metrics.py`).

Entry point for the CLI: ``run_nemo_rl(cfg, overrides) -> int``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import subprocess
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_jetrl.backends.nemo_rl.kv_backends import CUDA_FP8_KV
from nemo_jetrl.backends.nemo_rl.translate import (
    NEMO_RL_IMAGE,
    NEMO_RL_VERSION,
    POLICY_WORKER_FQN,
    STOCK_POLICY_WORKER,
    VLLM_PATCH_ENV,
    NemoRlPlan,
    TranslationError,
    translate,
)
from nemo_jetrl.backends.nemo_rl.tree_rules import TreeFacts, nemo_rl_package, read_tree
from nemo_jetrl.config.schema import VLLM_KV_DTYPE
from nemo_jetrl.megatron.config import FP32_SCALES_ENV

# Modules the backend needs in the driver process, with what each is for.
REQUIRED_MODULES: tuple[tuple[str, str], ...] = (
    ("nemo_rl", "NeMo-RL itself"),
    ("nemo_rl.algorithms.grpo", "NeMo-RL's GRPO (the PyPI 'nemo-rl' name is an empty placeholder)"),
    ("ray", "the Ray cluster NeMo-RL runs on"),
)


def _user_error(msg: str) -> Exception:
    from nemo_jetrl.errors import UserError

    return UserError(msg)


def missing_dependencies(find_spec: Any = importlib.util.find_spec) -> list[str]:
    """Names (with what they are for) of required modules that cannot be found."""
    out = []
    for mod, what in REQUIRED_MODULES:
        try:
            ok = find_spec(mod) is not None
        except (ImportError, ValueError):
            ok = False
        if not ok:
            out.append(f"{mod} ({what})")
    return out


def missing_message(missing: Sequence[str]) -> str:
    return (
        "the nemo-rl backend needs NeMo-RL " + NEMO_RL_VERSION + ", which is not installed here; "
        "missing: " + ", ".join(missing) + ".\n"
        "Run inside the Docker image, built on " + NEMO_RL_IMAGE + ":\n"
        "  docker build -f docker/Dockerfile -t nemo-jetrl:latest .\n"
        "  docker run --gpus all --rm -it -v $PWD:/workspace nemo-jetrl:latest \\\n"
        "    jetrl train CONFIG --backend nemo-rl\n"
        "(on SLURM: slurm/launch.sh, see docs/cluster.md). On a machine without GPUs use "
        "--backend local."
    )


@dataclass(frozen=True)
class Prepared:
    """A config ready for NeMo-RL."""

    plan: NemoRlPlan
    source: str
    warnings: tuple[str, ...] = ()
    arch: Any = None
    """The model's `ModelArch` as the config check read it (built-in or ``jetrl.model_config``);
    None when it had none and checked generic layers."""
    state_space: str | None = None
    """With no ``arch``: the evidence that the model has Mamba layers (`flow.support`), if so."""


def prepare(cfg: Any, overrides: Sequence[str] = ()) -> Prepared:
    """Steps 1-3: load, validate, check on-policy, translate. UserError on any user problem."""
    from omegaconf import DictConfig, OmegaConf

    from nemo_jetrl.config import ConfigError
    from nemo_jetrl.flow.pipeline import check_config, off_policy_refusal, run_notes
    from nemo_jetrl.flow.support import state_space_model

    source = str(cfg) if not isinstance(cfg, DictConfig) else "<config>"
    try:
        checked = check_config(cfg, overrides, run=True)
    except ConfigError as exc:
        raise _user_error(f"invalid config\n{exc}") from None
    refusal = off_policy_refusal(checked, backend="nemo-rl")
    if refusal:
        raise _user_error(refusal)
    conf, recipe, arch = checked.cfg, checked.recipe, checked.arch
    notes = run_notes(checked)
    ro = recipe.rollout
    hooked = ro.quantizer == "jetrl" and OmegaConf.select(conf, "jetrl.refit_hook") is not False
    if ro.fp8_linears and not ro.pow2_weight_scales and not hooked:
        # NeMo-RL's refit streams BF16 weights and quantizes them inside vLLM with its own code
        # unless our vLLM patch and refit hook (vllm_refit.py) are on; measured against TE's
        # formula it agrees bit for bit with power-of-two scales only.
        notes.append(
            "FP32 weight scales on the NeMo-RL backend: NeMo-RL's refit quantizes weights inside "
            "vLLM with its own code, which differed from TE's formula on 1-1,194 FP8 bytes per "
            "million in our CPU measurement (0 with power-of-two scales). For bit-identical "
            "weights use policy.generation.vllm_cfg.pow2_weight_scaling_factors=true with "
            f"policy.megatron_cfg.env_vars.{FP32_SCALES_ENV}='0'."
        )
    package = nemo_rl_package()  # the tree the run imports: its FP8 rules (tree_rules)
    try:
        plan = _translate(checked, read_tree(package) if package is not None else None)
    except TranslationError as exc:
        raise _user_error(str(exc)) from None
    described = None if checked.arch_note else arch  # a note: generic layers stood in
    ssm = state_space_model(checked.settings, described)  # Mamba layers: nothing to rehearse
    return Prepared(
        plan, source, warnings=tuple(notes), arch=described, state_space=ssm[1] if ssm else None
    )


def _translate(checked: Any, tree: TreeFacts | None) -> NemoRlPlan:
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(checked.cfg, resolve=True)
    assert isinstance(container, dict)
    hybrid = None if checked.arch_note else checked.arch.hybrid  # a note: generic layers
    split = None if hybrid is None else hybrid.split_proj
    return translate(
        container, checked.recipe, num_layers=checked.arch.num_layers, tree=tree,
        hf_in_proj_split=split,
    )  # fmt: skip


def launch_problems(checked: Any, tree: TreeFacts) -> list[tuple[str, str]]:
    """(key, why) for each reason ``jetrl train --backend nemo-rl`` would refuse the checked
    config on ``tree`` before Ray starts (`translate`'s, the trainer kind's); `jetrl check`
    lists them. The paths, venvs and vLLM version are the launch machine's: not asked here."""
    from omegaconf import OmegaConf

    from nemo_jetrl.backends.nemo_rl.driver import trainer_problems

    try:
        plan = _translate(checked, tree)
    except TranslationError as exc:  # the trainer's keys are the user's: reported together
        cfg = OmegaConf.to_container(checked.cfg, resolve=True)
        return [*exc.problems, *trainer_problems(cfg)]
    return trainer_problems(plan.master_config)


# -- worker registration (driver process) ---------------------------------------------------------


@contextlib.contextmanager
def registered_policy_worker(
    registry: MutableMapping[str, str], fqn: str = POLICY_WORKER_FQN, entry: str | None = None
) -> Iterator[str]:
    """Register our policy worker with the stock Megatron worker's Python environment; revert after.

    NeMo-RL refuses to start an actor whose class has no entry in ``ACTOR_ENVIRONMENT_REGISTRY``.
    ``entry``: the stock worker venv's python (`venvs.policy_worker_entry`); default the stock
    entry itself.
    """
    if STOCK_POLICY_WORKER not in registry:
        raise RuntimeError(
            f"NeMo-RL's actor registry has no {STOCK_POLICY_WORKER}: this NeMo-RL is not the "
            f"{NEMO_RL_VERSION} layout nemo_jetrl targets"
        )
    had = fqn in registry
    old = registry.get(fqn)
    registry[fqn] = entry or registry[STOCK_POLICY_WORKER]
    try:
        yield registry[fqn]
    finally:
        if had:
            registry[fqn] = old  # type: ignore[assignment]
        else:
            registry.pop(fqn, None)


def nemo_rl_pinned_vllm(nemo_rl_dir: Path) -> str | None:
    """The vLLM version NeMo-RL's ``pyproject.toml`` pins (``vllm==X`` / ``.../vllm-X-...whl``)."""
    import re

    try:
        text = (nemo_rl_dir / "pyproject.toml").read_text()
    except OSError:
        return None
    m = re.search(r'"vllm==([0-9][^ ;"]*)', text) or re.search(r"/vllm-([0-9][^-/]*)-", text)
    return m.group(1) if m else None


# Run by the vLLM workers' Python: its vLLM version and its vllm.general_plugins entry points.
_PREFLIGHT = (
    "import json, vllm\n"
    "from importlib.metadata import entry_points\n"
    "from vllm.platforms import current_platform\n"
    "eps = {e.name: e.value for e in entry_points(group='vllm.general_plugins')}\n"
    "print(json.dumps({'vllm': vllm.__version__, 'plugins': eps,\n"
    "                  'device': current_platform.device_type}))"
)


def preflight_vllm_patch(
    python: str,
    overlay: Path | None = None,
    *,
    run: Any = subprocess.run,
    pinned: str | None = None,
    fp8_kv: bool = False,
) -> None:
    """Refuse early when the vLLM in NeMo-RL's vLLM workers is outside the patch's range, or is
    not the one NeMo-RL pins (``pinned``: replaced, e.g. by ``pip install nemo-jetrl[vllm]``),
    or (``fp8_kv``: the recipe's FP8 KV cache) is not vLLM's CPU build: on CUDA every vLLM
    attention with an FP8 cache is refused at engine start (`kv_backends`), after Ray and the
    model load. Asked of vLLM's platform (its torch says nothing: vLLM's 0.20/0.25 CPU wheels
    ship CUDA torch); a GPU build on a head node without GPUs reports none (""), refused too.
    ``overlay``: first on that Python's ``PYTHONPATH``, as the launch will put it."""
    from nemo_jetrl.backends.nemo_rl.venvs import with_pythonpath
    from nemo_jetrl.vllm_patch.patch import UnsupportedVllmVersion, check_vllm_version

    env = None if overlay is None else {**os.environ, **with_pythonpath({}, overlay)}
    cmd = [python, "-c", _PREFLIGHT]
    proc = run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0:
        raise _user_error(
            f"cannot import vLLM with NeMo-RL's vLLM worker Python {python}: "
            f"{(proc.stderr or '').strip()[-500:]}"
        )
    import json

    from nemo_jetrl.backends.nemo_rl.engine_check import entry_point_problems

    found = json.loads(proc.stdout.strip().splitlines()[-1])
    version = found["vllm"]
    missing = entry_point_problems(found["plugins"], python)
    if missing:
        raise _user_error(
            "NeMo-RL's vLLM workers would start without nemo_jetrl's plugins (an off-policy "
            "rollout); nothing started:\n  - " + "\n  - ".join(m.removeprefix("worker 0: ")
                                                          for m in missing)
        )  # fmt: skip
    try:
        check_vllm_version(version)
    except UnsupportedVllmVersion as exc:
        raise _user_error(f"{exc} (found in NeMo-RL's vLLM worker environment {python})") from None
    if pinned and version.split("+")[0] != pinned:  # a local build tag (+cu130) is the same vLLM
        raise _user_error(
            f"NeMo-RL's vLLM worker environment {python} has vLLM {version}, but this NeMo-RL "
            f"pins vLLM {pinned}: the environment was changed (e.g. `pip install "
            "nemo-jetrl[vllm]` replaces NeMo-RL's vLLM; install nemo_jetrl with --no-deps). "
            "Rebuild the image (a container starts from it every job), or on bare metal launch "
            "once with NRL_FORCE_REBUILD_VENVS=true"
        )
    if fp8_kv and found.get("device") != "cpu":
        on = found.get("device") or "a GPU build (no GPU on this node)"
        raise _user_error(
            f"{VLLM_KV_DTYPE}=fp8 (the recipe's FP8 KV cache) on NeMo-RL's vLLM {version} "
            f"on {on} ({python}): {CUDA_FP8_KV}. Nothing started. "
            f"Use recipe jetrl (BF16 KV cache, {VLLM_KV_DTYPE}=auto: exactly the trainer's FP8 "
            "linears)"
        )


def vllm_preflight(plan: NemoRlPlan, nemo_rl_dir: Path) -> Any:
    """`preflight_vllm_patch` for this plan and NeMo-RL checkout (the driver calls it with the
    vLLM workers' Python): the launch's and the rehearsal's."""
    return functools.partial(
        preflight_vllm_patch, pinned=nemo_rl_pinned_vllm(nemo_rl_dir), fp8_kv=plan.recipe.kv_fp8
    )


def nemo_rl_defaults_path(environ: Mapping[str, str] | None = None) -> Path:
    """NeMo-RL's Megatron GRPO example config inside its checkout (``$NEMO_RL_DIR``, image: /opt/nemo-rl)."""
    env = os.environ if environ is None else environ
    return (
        Path(env.get("NEMO_RL_DIR", "/opt/nemo-rl")) / "examples/configs/grpo_math_1B_megatron.yaml"
    )


def merge_nemo_rl_defaults(master: Mapping[str, Any], base_yaml: Path) -> dict[str, Any]:
    """``master`` on top of NeMo-RL's own example config (its ``defaults:`` chain resolved).

    Our example configs spell out only the keys that matter for precision and GRPO; NeMo-RL's
    ``MasterConfig`` needs the rest (data, env, cluster, logger...), which its example supplies.
    """
    from omegaconf import OmegaConf

    from nemo_jetrl.config import load_config

    if not base_yaml.is_file():
        raise _user_error(
            f"NeMo-RL's default config {base_yaml} is missing: set NEMO_RL_DIR to the NeMo-RL "
            "checkout (the image has it at /opt/nemo-rl)"
        )
    merged = OmegaConf.merge(load_config(base_yaml), OmegaConf.create(dict(master)))
    out = OmegaConf.to_container(merged, resolve=True)
    assert isinstance(out, dict)
    return out


# -- launch (needs NeMo-RL) ----------------------------------------------------------------------


def launch(prepared: Prepared) -> int:  # pragma: no cover - NeMo-RL tier up to grpo.setup; GPUs
    """Step 5: NeMo-RL's GRPO, as examples/run_grpo.py runs it, with our pieces plugged in.

    Every check (trainer kind, paths, worker venvs, vLLM version) runs before ``init_ray``."""
    from nemo_rl.distributed import ray_actor_environment_registry as reg
    from nemo_rl.distributed.virtual_cluster import init_ray

    from nemo_jetrl.backends.nemo_rl import driver

    config, kind, entry, max_age = _master_config(prepared, reg.ACTOR_ENVIRONMENT_REGISTRY)
    with registered_policy_worker(reg.ACTOR_ENVIRONMENT_REGISTRY, entry=entry):
        init_ray()
        driver.train(config, prepared.plan, kind, max_age)
    return 0


def _master_config(prepared: Prepared, registry: Mapping[str, str]) -> Any:  # pragma: no cover
    """NeMo-RL's MasterConfig on its defaults after the driver's checks; (config, trainer kind,
    our worker's registry entry, async max trajectory age)."""
    from nemo_rl.algorithms.grpo import MasterConfig
    from nemo_rl.utils.config import register_omegaconf_resolvers
    from nemo_rl.utils.logger import get_next_experiment_dir

    from nemo_jetrl.backends.nemo_rl import driver, venvs
    from nemo_jetrl.build_info import version_line

    plan = prepared.plan
    defaults = nemo_rl_defaults_path()
    merged = merge_nemo_rl_defaults(plan.master_config, defaults)
    base = venvs.venv_dir()
    kind, entry, lines = driver.prepare_master(
        merged,
        plan.master_config,
        nemo_rl_dir=defaults.parents[2],
        venv_base=base,
        stock_entry=registry[STOCK_POLICY_WORKER],
        vllm_entry=registry.get(venvs.vllm_worker_fqn(merged), "python"),
        vllm_patch=VLLM_PATCH_ENV in plan.workers.vllm_env,
        environ=os.environ,
        next_log_dir=get_next_experiment_dir,
        preflight=vllm_preflight(plan, defaults.parents[2]),
    )
    register_omegaconf_resolvers()
    config = MasterConfig(**merged)
    log_dir = config.logger["log_dir"]
    print(f"jetrl: {version_line()}; recipe {plan.recipe.name}; trainer {kind}")
    print(f"jetrl: NeMo-RL log dir {log_dir} (TensorBoard: {log_dir}/tensorboard)")
    if config.checkpointing["enabled"]:
        print(f"jetrl: checkpoints {config.checkpointing['checkpoint_dir']}")
    for line in lines:
        print(f"jetrl: {line}")
    for w in prepared.warnings:
        print(f"jetrl: note: {w}")
    max_age = ((merged.get("grpo") or {}).get("async_grpo") or {}).get(
        "max_trajectory_age_steps", 1
    )
    return config, kind, entry, int(1 if max_age is None else max_age)  # 0: trainer_kind refused


def run_nemo_rl(cfg: Any, overrides: Sequence[str] = ()) -> int:
    """``jetrl train --backend nemo-rl``: prepare, check dependencies, launch; returns exit code.

    ``cfg`` is a YAML path or an OmegaConf DictConfig; ``overrides`` are ``key=value`` strings.
    User errors raise ``nemo_jetrl.cli.UserError`` (the CLI prints them, exit code 2).
    """
    prepared = prepare(cfg, overrides)
    missing = missing_dependencies()
    if missing:
        raise _user_error(missing_message(missing))
    return launch(prepared)
