"""Helpers of the NeMo-RL tier: NeMo-RL's real config loader and ``grpo.setup`` on CPU.

``drive_setup`` runs NeMo-RL's own ``grpo.setup`` (logger, checkpointing, data loaders, loss
function, cluster sizing, the vLLM FP8 / FP8-KV asserts, router-replay settings) until it builds
the vLLM generation workers. What needs GPUs is replaced by stand-ins, labelled as such: the Ray
virtual cluster's placement groups (``stand_in_cluster_class``: NeMo-RL's ``RayVirtualCluster``
subclassed, its constructor and asserts run; GPU bundles cannot be placed here) and the live Ray
node table (``get_ray_cluster_topology``, for configs with ``cluster.segment_size``), the vLLM
generation workers (``VllmGeneration``) and the Megatron policy (``policy_factory``), each of
those two a stop that first binds setup's call to the real class's signature. Reaching the generation stand-in
means every check of ``setup`` before it passed (v0.7.0 ``nemo_rl/algorithms/grpo.py``
lines 254-1060; main 7ea279a lines 434-1190).
"""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "configs"
MODELS = ("llama3.1_8b_instruct", "qwen2.5_7b", "qwen3_8b_base")
RECIPES = ("bf16", "fp8_rollout", "jetrl", "jetrl_kv")
PRESETS = [EXAMPLES / m / f"{r}.yaml" for m in MODELS for r in RECIPES] + [
    EXAMPLES / "nemo_rl_fp8_e2e.yaml"
]


def expected_refit_layout() -> set[str]:
    """The refit layout of the tree NeMo-RL is imported from (its upstream checkout folder
    name), else either layout."""
    import nemo_rl

    from nemo_jetrl.backends.nemo_rl.vllm_refit import LOADERS

    tree = Path(nemo_rl.__file__).resolve().parents[1].name
    return {tree} if tree in LOADERS.values() else set(LOADERS.values())


def nemo_rl_vllm_modules() -> tuple[Any, Any, Any]:
    """NeMo-RL's vllm_backend, quantization.fp8 and policy.utils; skips only when this tree
    needs another vLLM than the one installed (any other import error is raised)."""
    try:
        from nemo_rl.models.generation.vllm import vllm_backend
        from nemo_rl.models.generation.vllm.quantization import fp8
        from nemo_rl.models.policy import utils
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("vllm."):
            raise
        pytest.skip(f"this NeMo-RL tree needs another vLLM than the one installed ({exc})")
    return vllm_backend, fp8, utils


class ReachedGeneration(Exception):
    """Raised by the vLLM generation stand-in: setup's checks before it all passed."""


def stand_in_cluster_class() -> type:
    """NeMo-RL's own ``RayVirtualCluster`` (its ``__init__``, its asserts, every method) with
    only its placement groups replaced: GPU bundles cannot be placed on this CPU's Ray, and
    setup asks for them only on its non-colocated path. STAND-IN, a subclass of the real class."""
    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster

    class StandInCluster(RayVirtualCluster):
        def _init_placement_groups(self, strategy: Any = None, use_unified_pg: bool = False):
            self._node_placement_groups = []  # no GPU bundles here
            return self._node_placement_groups

    return StandInCluster


def tree_dir() -> Path:
    """The NeMo-RL source tree this process imports (the tier puts it on PYTHONPATH)."""
    import nemo_rl

    return Path(nemo_rl.__file__).resolve().parents[1]


def tree_name() -> str:
    return os.environ.get("JETRL_NEMO_RL_TREE") or tree_dir().name


def nemo_rl_load(path: Path, overrides: list[str] = ()) -> dict:
    """NeMo-RL's loader, as examples/run_grpo.py uses it: resolvers, load, Hydra overrides."""
    from nemo_rl.utils.config import (
        load_config,
        parse_hydra_overrides,
        register_omegaconf_resolvers,
    )
    from omegaconf import OmegaConf

    register_omegaconf_resolvers()
    cfg = load_config(str(path))
    if overrides:
        cfg = parse_hydra_overrides(cfg, list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


def with_nemo_rl_defaults(master: dict) -> dict:
    """Our launch's merge onto NeMo-RL's Megatron GRPO example (the tree under test)."""
    from nemo_jetrl.backends.nemo_rl.launch import merge_nemo_rl_defaults

    base = tree_dir() / "examples" / "configs" / "grpo_math_1B_megatron.yaml"
    return merge_nemo_rl_defaults(master, base)


def _cpu_settings(cfg: dict, tmp: Path) -> dict:
    """Logging and checkpoints into ``tmp``, no GPU monitor (no GPU here)."""
    logger = cfg.setdefault("logger", {})
    logger.update(
        log_dir=str(tmp / "logs"),
        wandb_enabled=False,
        tensorboard_enabled=False,
        mlflow_enabled=False,
        swanlab_enabled=False,
        monitor_gpus=False,
    )
    ckpt = cfg.setdefault("checkpointing", {})
    ckpt.update(enabled=False, checkpoint_dir=str(tmp / "ckpt"))
    return cfg


def drive_setup(cfg: dict, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """NeMo-RL's MasterConfig + grpo.setup up to the vLLM workers; returns the MasterConfig."""
    from nemo_rl.algorithms import grpo

    master = grpo.MasterConfig(**_cpu_settings(cfg, tmp))
    assert master.policy["generation"]["backend"] == "vllm"

    from nemo_rl.models.policy.lm_policy import Policy

    def stops_here(real: Any) -> Any:
        """STAND-IN for ``real`` (vLLM workers, the Megatron policy: GPUs): setup's call must
        fit the real signature, then setup stops here."""

        def stand_in(*args: Any, **kwargs: Any) -> Any:
            inspect.signature(real).bind(*args, **kwargs)
            raise ReachedGeneration()

        return stand_in

    generation_stand_in = stops_here(grpo.VllmGeneration)

    cluster_cls = stand_in_cluster_class()
    assert cluster_cls.__init__ is grpo.RayVirtualCluster.__init__  # the real constructor
    monkeypatch.setattr(grpo, "RayVirtualCluster", cluster_cls)
    # Stand-in for the live Ray cluster's node table (segment_size configs query it): the
    # configured nodes, with no NVLink domain info (NeMo-RL's own "unknown" values).
    vc = importlib.import_module("nemo_rl.distributed.virtual_cluster")
    nodes = {
        f"node{i}": (vc.NVLINK_DOMAIN_UNKNOWN, getattr(vc, "TOPO_RANK_UNKNOWN", -1))
        for i in range(int(cfg["cluster"]["num_nodes"]))
    }
    for module in (vc, grpo):
        if hasattr(module, "get_ray_cluster_topology"):
            monkeypatch.setattr(module, "get_ray_cluster_topology", lambda: dict(nodes))
    monkeypatch.setattr(grpo, "VllmGeneration", generation_stand_in)
    grpo_cfg = master.grpo  # a dict in v0.7.0, a pydantic GRPOConfig in main
    n = (
        grpo_cfg["num_prompts_per_step"]
        if isinstance(grpo_cfg, dict)
        else grpo_cfg.num_prompts_per_step
    )
    data = [{"idx": i} for i in range(n)]
    with pytest.raises(ReachedGeneration):
        grpo.setup(master, None, data, data, policy_factory=stops_here(Policy))
    return master


def _source_function(module_file: str, name: str, namespace: dict) -> Any:
    """Compile one top-level function, unchanged, from a file of the NeMo-RL tree."""
    import ast

    path = tree_dir() / module_file
    (node,) = [n for n in ast.parse(path.read_text()).body if getattr(n, "name", None) == name]
    exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    return namespace[name]


def _pack_parameters_function() -> Any:
    """NeMo-RL's ``_get_pack_sequence_parameters_for_megatron``.

    v0.7.0: imported. main's ``nemo_rl/models/megatron/data.py`` imports Megatron-Bridge (the
    overlay's 0.3.1 imports Transformer Engine, GPU builds only) and its ``common.py`` a newer
    megatron-core at the top; the function uses neither, only the pure ``_round_up_to_multiple``
    of ``common.py``. There both functions are compiled, unchanged, from the tree's source files.
    """
    try:
        from nemo_rl.models.megatron.data import _get_pack_sequence_parameters_for_megatron
    except ModuleNotFoundError as exc:
        name = str(exc.name or "")
        if not (name.startswith("megatron.") or name.split(".")[0] == "transformer_engine"):
            raise
    else:
        return _get_pack_sequence_parameters_for_megatron
    ns: dict = {"Optional": __import__("typing").Optional}
    _source_function("nemo_rl/models/megatron/common.py", "_round_up_to_multiple", ns)
    return _source_function(
        "nemo_rl/models/megatron/data.py", "_get_pack_sequence_parameters_for_megatron", ns
    )


def check_sequence_padding(master: Any) -> tuple[int, int, int | None]:
    """NeMo-RL's own packing parameters for the config (asserts its padding rules)."""
    policy = master.policy
    return _pack_parameters_function()(
        policy["megatron_cfg"],
        policy["make_sequence_length_divisible_by"],
        policy["max_total_sequence_length"],
    )


def _declares_fp8(doc: Any) -> bool:
    """The file itself sets an FP8 rollout, FP8 KV cache or FP8 training (raw YAML)."""
    if not isinstance(doc, dict):
        return False
    policy = doc.get("policy") or {}
    vllm = ((policy.get("generation") or {}).get("vllm_cfg")) or {}
    fp8_cfg = ((policy.get("megatron_cfg") or {}).get("fp8_cfg")) or {}
    return (
        vllm.get("precision") == "fp8"
        or str(vllm.get("kv_cache_dtype", "")).startswith("fp8")
        or fp8_cfg.get("enabled") is True
    )


def fp8_grpo_configs(tree: Path) -> list[Path]:
    """Every GRPO config under the tree's examples/configs whose resolved config (NeMo-RL's own
    loader) has FP8 on some side. Candidates first: a file or an ancestor through `defaults:`
    that sets FP8 in its raw YAML (cheap); NeMo-RL's loader then decides."""
    import yaml

    raw: dict[Path, Any] = {}

    def chain_fp8(p: Path, seen: tuple = ()) -> bool:
        if p in seen or not p.is_file():
            return False
        if p not in raw:
            raw[p] = yaml.safe_load(p.read_text())
        doc = raw[p]
        if _declares_fp8(doc):
            return True
        parents = (doc or {}).get("defaults") if isinstance(doc, dict) else None
        parents = [parents] if isinstance(parents, str) else list(parents or [])
        return any(chain_fp8((p.parent / str(q)).resolve(), (*seen, p)) for q in parents)

    out = []
    for p in sorted((tree / "examples" / "configs").rglob("*grpo*.yaml")):
        if not chain_fp8(p.resolve()):
            continue
        cfg = nemo_rl_load(p)
        pol = cfg.get("policy") or {}
        vllm = (pol.get("generation") or {}).get("vllm_cfg") or {}
        fp8_cfg = (pol.get("megatron_cfg") or {}).get("fp8_cfg") or {}
        if (
            vllm.get("precision") == "fp8"
            or str(vllm.get("kv_cache_dtype")).startswith("fp8")
            or fp8_cfg.get("enabled") is True
        ):
            out.append(p)
    return out
