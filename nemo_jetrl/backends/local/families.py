"""Which mixture-of-experts models the local backend runs: one home for the rule, torch-free so
the flow's per-backend verdict and `jetrl train`'s config check read it before any work starts.

The local backend swaps HF's sparse MoE blocks for its own (`nemo_jetrl.backends.local.moe`):
Qwen3-MoE's and Mixtral's (router ``mlp.gate``, fused ``mlp.experts``), routed experts only. Any
other MoE family (DeepSeek-V3 / Moonlight, Qwen3-Next / Qwen3.5-MoE, Qwen2-MoE, MiniMax-M2) and
any model with shared experts is not run by it, so no local verdict can be claimed for them.
"""

from __future__ import annotations

from typing import Any

LOCAL_MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")


def local_family_problem(arch: Any) -> str | None:
    """Why the local backend does not run ``arch`` (a `ModelArch`), or None (dense, or an MoE
    family it runs)."""
    if getattr(arch, "mamba", None) is not None:
        return (
            f"{arch.name} has Mamba-2 layers (Nemotron-H); the local backend builds no Mamba mixer"
        )
    moe = getattr(arch, "moe", None)
    if arch is None or moe is None:
        return None
    if arch.model_type not in LOCAL_MOE_MODEL_TYPES:
        return (
            f"{arch.name} is a {arch.model_type!r} mixture of experts; the local backend runs "
            f"the MoE blocks of {', '.join(LOCAL_MOE_MODEL_TYPES)} only"
        )
    if moe.shared_size:
        return (
            f"{arch.name} has shared experts ({moe.shared_module}); the local backend's MoE "
            "block computes routed experts only"
        )
    return None
