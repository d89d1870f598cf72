"""Names of MoE tensors and modules between HF checkpoints and vLLM (no vLLM import).

* `resolve_expert_tensor`: an HF per-expert tensor (``mlp.experts.{e}.{gate,up,down}_proj``
  ``.weight`` / ``.weight_scale_inv``) -> expert ``e``'s rows of vLLM's fused ``w13``/``w2``
  parameters (used by the refit's shape guard, load and parity read-back, ``worker_ext``).
* `router_modules`: vLLM names of a model's routers, which stay BF16 (``VllmRolloutEngine`` adds
  them to ``modules_to_not_convert``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

_EXPERT_NAME = re.compile(r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
# HF per-expert projection -> (vLLM parameter prefix, shard index within it)
_EXPERT_SHARDS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}


def resolve_expert_tensor(model: Any, hf_name: str) -> tuple[str, torch.Tensor, int, int] | None:
    """(vLLM name, the expert's slice of the parameter, row start, row count) for an HF
    per-expert tensor such as ``model.layers.1.mlp.experts.3.up_proj.weight`` (or its
    ``weight_scale_inv``) in a routed-experts layer; None for any other name."""
    match = _EXPERT_NAME.match(hf_name)
    if match is None:
        return None
    path, expert, proj, leaf = match.groups()
    try:
        layer = model.get_submodule(path)
    except AttributeError:
        return None
    inner = getattr(layer, "routed_experts", None)  # 0.32: the runner holds RoutedExperts
    if not hasattr(layer, "w13_weight") and isinstance(inner, torch.nn.Module):
        layer, path = inner, f"{path}.routed_experts"
    prefix, shard = _EXPERT_SHARDS[proj]
    if leaf not in ("weight", "weight_scale_inv") or not hasattr(layer, f"{prefix}_weight"):
        return None
    param = getattr(layer, f"{prefix}_{leaf}")
    rows = param.shape[1] // (2 if prefix == "w13" else 1)
    return f"{path}.{prefix}_{leaf}", param.data[int(expert)], shard * rows, rows


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
