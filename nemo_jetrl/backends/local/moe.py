"""Mixture-of-experts blocks on the local backend: one block both sides run, swapped in reversibly.

`convert_moe_blocks` replaces each HF sparse MoE block (``Qwen3MoeSparseMoeBlock``,
``MixtralSparseMoeBlock``: router ``mlp.gate``, fused experts ``mlp.experts``) by a `MoeBlock`
that keeps the router module and the expert parameters (same objects, same state-dict keys) and
computes:

1. routing (`nemo_jetrl.invariant.moe`): router logits, fp32 softmax, top-k with ties to the
   lower expert index, top-k weights (renormalised when the model says so: Qwen3-MoE's
   ``norm_topk_prob``, always for Mixtral). The router is never FP8;
2. the experts (`moe_experts.Experts`) on the routed rows sorted by expert (each row's token
   given, so an FP8 rollout quantizes the tokens once and gathers codes), FP8 where the side's
   filters say (the dense linears' rules: ``bf16_first_layers`` / ``bf16_last_layers``,
   ``bf16_layer_kws`` matched on ``...experts.gate_up_proj`` / ``...experts.down_proj``);
3. the weighted sum of the k expert outputs in slot order (fp32, cast once).

Routing record and replay (`routing.RoutingController` drives them): with ``record`` set, each
forward appends its own top-k ``[B, S, k]``; with ``replay`` set (``[B0, S, k]`` experts and a
``[B0, S]`` validity mask, R3), the block uses those experts where valid and its own elsewhere,
weighting them by its own router's probabilities (so the router still gets a gradient).
`make_batch_invariant` turns the block's batch-invariant ops on (``set_batch_invariant``).
Nothing is patched at import; `MoeHandle.restore` puts the HF blocks back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nemo_jetrl.backends.local.moe_experts import PROJECTIONS, Experts, fp8_dims_problem
from nemo_jetrl.fp8 import Fp8LinearConfig
from nemo_jetrl.invariant import moe as imoe
from nemo_jetrl.recipe_parts import SideRecipe

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# config.json keys that count routed experts (Qwen3-MoE, Mixtral).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")
# The families whose blocks these are: `families.LOCAL_MOE_MODEL_TYPES` (read at config check).


def num_experts(config: Any) -> int:
    """Routed experts per MoE layer (0: a dense model); reads a config object or a dict."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    for key in EXPERT_COUNT_KEYS:
        v = get(key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def _normalizes(config: Any) -> bool:
    """Whether the top-k weights are renormalised to sum 1 (Mixtral always; Qwen3-MoE by key)."""
    if getattr(config, "model_type", "") == "mixtral":
        return True
    return bool(getattr(config, "norm_topk_prob", False))


class MoeBlock(nn.Module):
    """One MoE block (see the module docstring); ``gate`` is the HF router module (its
    ``weight`` ``[E, H]``), ``experts`` an `Experts`."""

    def __init__(
        self, gate: nn.Module, experts: Experts, *, top_k: int, normalize: bool, layer: int
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.top_k, self.normalize, self.layer = top_k, normalize, layer
        self.num_experts = int(gate.weight.shape[0])
        self.invariant = False
        self.record: list[torch.Tensor] | None = None
        self.replay: tuple[torch.Tensor, torch.Tensor] | None = None
        self.last_used: torch.Tensor | None = None
        """``[B, S, k]`` experts the last forward computed with (replayed or its own)."""

    def set_batch_invariant(self, on: bool) -> None:
        """Called by `make_batch_invariant` (and its restore)."""
        self.invariant = on
        self.experts.invariant = on

    def _choose(self, own: torch.Tensor, b: int, s: int) -> torch.Tensor:
        if self.replay is None:
            return own
        experts, valid = self.replay
        if experts.shape[0] < b or experts.shape[1] != s:
            raise ValueError(
                f"routing replay for layer {self.layer} holds {tuple(experts.shape[:2])} "
                f"(rows, positions), the forward has ({b}, {s})"
            )
        # a forward over the first rows of the batch (the update guard's probe) replays those rows
        rep, ok = experts[:b].reshape(b * s, -1).long(), valid[:b].reshape(b * s, 1)
        return torch.where(ok, rep, own)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden.shape
        x = hidden.reshape(b * s, h)
        inv = self.invariant
        logits = imoe.router_logits(x, self.gate.weight, invariant=inv)
        probs = imoe.router_probs(logits, invariant=inv)
        own = imoe.top_k(probs, self.top_k)
        if self.record is not None:
            self.record.append(own.reshape(b, s, self.top_k).to(torch.int32))
        idx = self._choose(own, b, s)
        self.last_used = idx.detach().reshape(b, s, self.top_k)
        w = imoe.slot_weights(probs, idx, normalize=self.normalize, invariant=inv)
        order, offsets = imoe.group_by_expert(idx, self.num_experts)
        ys = self.experts(x, order // self.top_k, offsets)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = ys[inverse].reshape(b * s, self.top_k, h)
        return imoe.combine(y, w, invariant=inv).to(hidden.dtype).reshape(b, s, h)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, experts={self.num_experts}, top_k={self.top_k}"


@dataclass
class MoeHandle:
    """The MoE blocks swapped into one model; `restore` puts HF's back (idempotent)."""

    blocks: list[MoeBlock] = field(default_factory=list)
    fp8: list[str] = field(default_factory=list)
    """Expert projections running FP8 (``model.layers.1.mlp.experts.gate_up_proj``)."""
    kept: dict[str, str] = field(default_factory=dict)
    """Expert projections kept BF16, with why."""
    _swaps: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)

    def restore(self) -> None:
        for parent, attr, original in reversed(self._swaps):
            setattr(parent, attr, original)
        self._swaps.clear()


def _is_hf_moe_block(mod: nn.Module) -> bool:
    ex = getattr(mod, "experts", None)
    return (
        type(mod).__name__.endswith("SparseMoeBlock")
        and hasattr(getattr(mod, "gate", None), "weight")
        and all(isinstance(getattr(ex, p, None), nn.Parameter) for p in PROJECTIONS)
    )


def _expert_fp8(
    name: str, hf_experts: nn.Module, side: SideRecipe, cfg: Fp8LinearConfig | None, n: int
) -> tuple[dict[str, Fp8LinearConfig], dict[str, str]]:
    fp8, kept = {}, {}
    m = _LAYER_RE.search(name)
    layer = int(m.group(1)) if m else -1
    for which in PROJECTIONS:
        full = f"{name}.{which}"
        problem = fp8_dims_problem(getattr(hf_experts, which))
        if cfg is None or layer < 0 or not side.is_fp8_linear(full, layer, n):
            kept[full] = "BF16 on this side (recipe layers / bf16_layer_kws)"
        elif problem:
            kept[full] = problem
        else:
            fp8[which] = cfg
    return fp8, kept


def convert_moe_blocks(
    model: nn.Module,
    side: SideRecipe,
    config: Fp8LinearConfig | None,
    *,
    quantizer: str | None = None,
) -> MoeHandle:
    """Swap every HF sparse MoE block of ``model`` for a `MoeBlock` (see the module docstring).

    ``config``: the side's FP8 config (None: all experts BF16); ``quantizer`` None builds the
    training side (shared parameters), else the rollout side with that `Fp8InferenceLinear`
    quantizer. A dense model gets an empty handle."""
    cfg_m = model.config
    handle = MoeHandle()
    if not num_experts(cfg_m):
        return handle
    if getattr(cfg_m, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg_m.hidden_act!r}: MoE experts support silu only")
    n = int(cfg_m.num_hidden_layers)
    for name, mod in list(model.named_modules()):
        if not _is_hf_moe_block(mod):
            continue
        shared = [a for a in ("shared_expert", "shared_experts") if hasattr(mod, a)]
        if shared:  # MoeBlock computes routed experts only: swapping would drop them
            raise ValueError(
                f"{name}.{shared[0]}: shared experts are not run by the local backend's MoE "
                "blocks (Qwen3-MoE and Mixtral only)"
            )
        fp8, kept = _expert_fp8(f"{name}.experts", mod.experts, side, config, n)
        ex_name = f"{name}.experts"
        experts = (
            Experts.for_training(mod.experts, ex_name, fp8)
            if quantizer is None
            else Experts.for_rollout(mod.experts, ex_name, fp8, quantizer)
        )
        m = _LAYER_RE.search(f"{name}.")
        block = MoeBlock(
            mod.gate,
            experts,
            top_k=int(cfg_m.num_experts_per_tok),
            normalize=_normalizes(cfg_m),
            layer=int(m.group(1)) if m else -1,
        )
        block.train(mod.training)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        handle._swaps.append((parent, attr, mod))
        setattr(parent, attr, block)
        handle.blocks.append(block)
        handle.fp8 += [f"{ex_name}.{w}" for w in fp8]
        handle.kept.update(kept)
    if not handle.blocks and moe_blocks(model):
        raise ValueError(f"{type(model).__name__}: its MoE blocks were converted already")
    if not handle.blocks:
        raise ValueError(
            f"{type(model).__name__} has {num_experts(cfg_m)} experts per layer but no sparse MoE "
            "block this backend knows (Qwen3-MoE, Mixtral: mlp.gate + fused mlp.experts)"
        )
    return handle


def moe_blocks(model: nn.Module) -> list[MoeBlock]:
    """The `MoeBlock` modules of ``model``, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoeBlock)]
