"""How NeMo-RL splits the cluster's GPUs between training and vLLM, checked before Ray starts.

NeMo-RL's ``grpo.setup`` (both trees) gives training every GPU of the cluster when vLLM is
colocated; otherwise, on one node, ``cluster.gpus_per_node`` minus generation's
``policy.generation.colocated.resources.gpus_per_node``, and on several nodes the nodes
generation does not take (``...resources.num_nodes``, whose GPUs per node must equal the
cluster's). Training's world size must then be a multiple of Megatron's TP x PP x CP
(``lm_policy.py``) and generation's of vLLM's TP x PP (``vllm_generation.py``). NeMo-RL asserts
all this after the job has allocated its nodes and started Ray; `resource_problems` says it
from the config, naming the keys. A reward-model environment and on-policy-distillation
teachers on their own nodes take GPUs of their own: those configs are left to NeMo-RL.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_RESOURCES = "policy.generation.colocated.resources"


def _int(node: Mapping[str, Any], key: str, default: int | None = None) -> int | None:
    v = node.get(key, default)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass(frozen=True)
class GpuSplit:
    train: int
    """GPUs NeMo-RL gives training (Megatron's world size)."""
    generation: int
    """GPUs vLLM gets (the same ones when colocated)."""
    how: str
    """How ``train`` was counted, for messages."""


def gpu_split(cfg: Mapping[str, Any], problems: list[tuple[str, str]]) -> GpuSplit | None:
    """NeMo-RL's split of this config's GPUs; None when the config does not say (missing or
    interpolated values, a reward model, OPD teachers on their own nodes) or when it cannot be
    split (appended to ``problems``)."""
    cluster = cfg.get("cluster") or {}
    nodes, per_node = _int(cluster, "num_nodes"), _int(cluster, "gpus_per_node")
    opd = (cfg.get("on_policy_distillation") or {}).get("non_colocated_teachers") or {}
    if nodes is None or per_node is None or "reward_model" in (cfg.get("env") or {}):
        return None
    if opd.get("enabled"):  # teachers' nodes come off training's first (grpo.setup)
        return None
    generation = (cfg.get("policy") or {}).get("generation") or {}
    colocated = generation.get("colocated") or {}
    if colocated.get("enabled", True) is not False:
        total = nodes * per_node
        return GpuSplit(total, total, f"all {total} (vLLM colocated)")
    res = colocated.get("resources") or {}
    g_nodes, g_per_node = res.get("num_nodes"), res.get("gpus_per_node")
    if nodes == 1:
        if isinstance(g_per_node, int) and 0 < g_per_node < per_node:
            train = per_node - g_per_node
            how = f"{train} (cluster.gpus_per_node={per_node} - {g_per_node} for vLLM)"
            return GpuSplit(train, g_per_node, how)
        problems.append((
            f"{_RESOURCES}.gpus_per_node",
            f"{g_per_node}: with vLLM on its own GPUs on one node, generation takes this many "
            f"of the node's {per_node} and training the rest: set it between 1 and "
            f"{per_node - 1}",
        ))  # fmt: skip
        return None
    ok = True
    if not isinstance(g_nodes, int) or not 0 < g_nodes < nodes:
        ok = False
        problems.append((
            f"{_RESOURCES}.num_nodes",
            f"{g_nodes}: with vLLM on its own GPUs on {nodes} nodes, generation takes whole "
            f"nodes and training the rest: set it between 1 and {nodes - 1}",
        ))  # fmt: skip
    if g_per_node != per_node:
        ok = False
        problems.append((
            f"{_RESOURCES}.gpus_per_node",
            f"{g_per_node}: on several nodes NeMo-RL gives generation whole nodes: set it to "
            f"cluster.gpus_per_node ({per_node})",
        ))  # fmt: skip
    if not ok:
        return None
    train = (nodes - g_nodes) * per_node
    how = f"{train} ({nodes - g_nodes} of cluster.num_nodes={nodes} x {per_node}; rest for vLLM)"
    return GpuSplit(train, g_nodes * per_node, how)


def resource_problems(cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, why) for each way NeMo-RL's GPU split of this config fails at ``grpo.setup``."""
    problems: list[tuple[str, str]] = []
    split = gpu_split(cfg, problems)
    if split is None:
        return problems
    policy = cfg.get("policy") or {}
    megatron = policy.get("megatron_cfg") or {}
    if megatron.get("enabled") is not True:  # a DTensor policy: translate refuses it
        megatron = {}
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
    sizes = {k: _int(megatron, k, 1) for k in keys}
    if None not in sizes.values():
        need = 1
        for v in sizes.values():
            need *= v  # type: ignore[operator]
        if split.train % need:
            shape = " x ".join(f"{k.split('_')[0]}={v}" for k, v in sizes.items())
            problems.append((
                "policy.megatron_cfg.tensor_model_parallel_size",
                f"{sizes['tensor_model_parallel_size']}: NeMo-RL gives training {split.how} "
                f"GPUs, not a multiple of Megatron's {shape} = {need}: change the parallel sizes "
                "(tensor/pipeline/context) or the GPUs",
            ))  # fmt: skip
    generation = policy.get("generation") or {}
    vllm = generation.get("vllm_cfg") or {}
    tp, pp = _int(vllm, "tensor_parallel_size", 1), _int(vllm, "pipeline_parallel_size", 1)
    on_vllm = generation.get("backend", "vllm") == "vllm"
    if on_vllm and tp is not None and pp is not None and split.generation % (tp * pp):
        problems.append((
            "policy.generation.vllm_cfg.tensor_parallel_size",
            f"{tp}: vLLM gets {split.generation} GPUs, not a multiple of its tensor x pipeline "
            f"parallel size {tp} x {pp} = {tp * pp}: change them or generation's GPUs",
        ))  # fmt: skip
    return problems
