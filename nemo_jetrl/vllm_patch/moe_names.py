"""Names of MoE tensors and modules between HF checkpoints and vLLM (no vLLM import).

* `resolve_expert_tensor`: an HF per-expert tensor (``mlp.experts.{e}.{gate,up,down}_proj``
  ``.weight`` / ``.weight_scale_inv``) -> expert ``e``'s rows of vLLM's fused ``w13``/``w2``
  parameters (used by the refit's shape guard, load and parity read-back, ``worker_ext``).
* `router_modules`: vLLM names of a model's routers, which stay BF16 (``VllmRolloutEngine`` adds
  them to ``modules_to_not_convert``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from nemo_jetrl.vllm_patch.expert_shards import (
    EXPERT_SHARDS,
    experts_layer,
    local_expert,
    split_expert_name,
)


def resolve_expert_tensor(model: Any, hf_name: str) -> tuple[str, torch.Tensor, int, int] | None:
    """(vLLM name, this rank's slice of the parameter for the expert, row start, row count) for
    an HF per-expert tensor such as ``model.layers.1.mlp.experts.3.up_proj.weight`` (or its
    ``weight_scale_inv``) in a routed-experts layer; None for any other name. Under tensor
    parallel the slice is the rank's shard (``expert_shards.hf_slice`` says which part of the HF
    tensor); under expert parallel the global id is mapped to the local one, and an expert held
    by another rank raises `NotLocalExpert`."""
    parts = split_expert_name(hf_name)
    if parts is None:
        return None
    from nemo_jetrl.vllm_patch.engine_names import engine_path

    path, expert, proj, leaf = parts
    path = engine_path(model, path)  # the engine's module path (Qwen3.5: language_model.model.)
    layer = experts_layer(model, path)
    prefix, shard = EXPERT_SHARDS[proj]
    if layer is None or leaf not in ("weight", "weight_scale_inv"):
        return None
    if layer is not model.get_submodule(path):
        path = f"{path}.routed_experts"  # 0.32: the runner holds RoutedExperts
    local = local_expert(layer, expert)
    if local is None:
        raise NotLocalExpert(f"{hf_name}: expert {expert} is held by another expert-parallel rank")
    param = getattr(layer, f"{prefix}_{leaf}")
    rows = param.shape[1] // (2 if prefix == "w13" else 1)
    return f"{path}.{prefix}_{leaf}", param.data[local], shard * rows, rows


class NotLocalExpert(KeyError):
    """An expert-parallel engine holds this routed expert on another rank."""


def router_modules(model_dir: str | Path) -> tuple[str, ...]:
    """vLLM names of the MoE routers of the HF model in ``model_dir`` (its config.json), which
    stay BF16 (``modules_to_not_convert``); empty for a dense model or without a config."""
    from nemo_jetrl.arch.model import ModelArch
    from nemo_jetrl.arch.moe import EXPERT_COUNT_KEYS

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return ()
    cfg = json.loads(path.read_text())
    if not any(cfg.get(k) for k in EXPERT_COUNT_KEYS):
        return ()  # dense: nothing to read (and no model description needed)
    arch = ModelArch.from_hf_config(cfg)
    names = [lin.name for lin in arch.linears() if lin.group == "router"]
    if cfg.get("model_type") == "mixtral":  # vLLM's Mixtral keeps HF's old block name
        names += [n.replace(".mlp.gate", ".block_sparse_moe.gate") for n in names]
    return tuple(names)
