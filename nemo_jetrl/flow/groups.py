"""The verdict per group of linears, and whether an MoE model's routing is replayed.

`jetrl check` prints one line per group the model has (`nemo_jetrl.arch.linear.GROUPS`:
attention, linear attention, dense MLP, router, experts, shared experts, vision tower,
embeddings, lm_head, plus the KV cache): the training forward's and the rollout's precision and
whether every rollout tensor of the group equals its training-forward tensor. What this says
is what the flow models: the tensors entering each GEMM, not the GEMMs' outputs.

Routing is not a tensor the flow compares. The router stays BF16/FP32 on both sides, but vLLM's
router GEMM and Megatron's are different kernels, so their logits can differ in the last bits
and pick different top-k experts for a token: a different policy however exact the experts
are. NeMo-RL's routing replay (`policy.router_replay.enabled`, R3) makes the trainer use the
experts the rollout picked; `routing_note` says which case a config is in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_jetrl.arch import ModelArch
from nemo_jetrl.config import Settings
from nemo_jetrl.config import schema as S
from nemo_jetrl.flow.check import FlowCheck, format_ranges
from nemo_jetrl.flow.graph import BF16, same_numbers
from nemo_jetrl.flow.table import ORDER, cell_text

ROUTER_REPLAY_KEY = S.ROUTER_REPLAY
ROUTING_METRIC = "jetrl/moe/routing_mismatch"
LABELS = {
    "embed": "embeddings",
    "attn": "attention",
    "kv": "KV cache",
    "linear_attn": "linear attention",
    "mamba": "Mamba-2 mixers",
    "mlp": "dense MLP",
    "router": "router",
    "moe_latent": "MoE latent projections",
    "experts": "experts",
    "shared_experts": "shared experts",
    "vision": "vision tower",
    "lm_head": "lm_head",
}


@dataclass(frozen=True)
class GroupVerdict:
    """One group's verdict."""

    group: str
    """Edge group ("attn", "experts", ...)."""

    layers: str
    """Decoder layers holding it ("0-47", "-" outside the decoder)."""

    train: str
    """The training forward's precisions (as the flow table writes a cell)."""

    rollout: str
    """The rollout's precisions (as the flow table writes a cell)."""

    same: bool
    """Every rollout edge of the group equals its training-forward edge."""

    @property
    def label(self) -> str:
        return LABELS.get(self.group, self.group)


def group_verdicts(check: FlowCheck) -> list[GroupVerdict]:
    """One verdict per group present in the rollout flow, in `ORDER`."""
    fwd = check.train_fwd.by_key()
    per: dict[str, dict[str, Any]] = {}
    for e in check.rollout.edges:
        t = fwd.get(e.key)
        tp = t.precision if t else BF16
        d = per.setdefault(e.group, {"layers": set(), "t": {}, "r": {}, "same": True})
        if e.layer is not None:
            d["layers"].add(e.layer)
        d["t"][(e.role, tp)] = None
        d["r"][(e.role, e.precision)] = None
        d["same"] &= t is not None and same_numbers(tp, e.precision)
    out = []
    for g in sorted(per, key=lambda g: ORDER.index(g) if g in ORDER else len(ORDER)):
        d = per[g]
        layers = format_ranges(sorted(d["layers"])) if d["layers"] else "-"
        t, r = cell_text(list(d["t"])), cell_text(list(d["r"]))
        out.append(GroupVerdict(g, layers, t, r, d["same"]))
    return out


def routing_note(settings: Settings, arch: ModelArch) -> str | None:
    """Whether routing is replayed, for an MoE model (None for a dense one)."""
    if arch.moe is None:
        return None
    replay = settings.moe.router_replay is True
    moe = arch.moe
    head = f"{moe.num_experts} experts, top-{moe.top_k}, {len(moe.moe_layers)} MoE layers"
    if replay:
        return (
            f"routing ({head}): REPLAYED ({ROUTER_REPLAY_KEY}=true): the trainer uses the experts "
            f"the rollout picked; {ROUTING_METRIC} still reports the fraction of top-k choices "
            "its own router would have changed"
        )
    return (
        f"routing ({head}): NOT replayed ({ROUTER_REPLAY_KEY} is not true): the router stays "
        "BF16/FP32 on both sides, but a BF16 router computed by two different GEMMs (vLLM's, "
        "Megatron's) can pick different top-k experts for a token, a different policy however "
        f"exact the experts are; {ROUTING_METRIC} measures it per step on the local backend. "
        f"Set {ROUTER_REPLAY_KEY}=true to train on the rollout's experts"
    )
