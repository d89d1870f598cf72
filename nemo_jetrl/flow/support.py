"""What no backend can run on-policy yet, refused by name (exit 2).

The flow reads mixture-of-experts models group by group (`nemo_jetrl.arch.moe`: attention,
dense MLP, router, experts, shared experts), but an FP8 MoE run cannot be made on-policy yet:

- Mixture-of-experts models with FP8 on some side: the rollout's expert GEMMs
  (``mlp.experts.*.{gate,up,down}_proj``) go through vLLM's FusedMoE FP8 path with its own
  per-token-group activation quantizer, and ``nemo_jetrl.vllm_patch`` has no experts kernel to
  put in its place yet (`flow.graph.ROLLOUT_EXPERTS_IMPL`). Seen from the config: the model's
  description (a built-in or config.json with experts), expert parallelism, Megatron's MoE
  sizes, or a model name of a known MoE family. `jetrl check` prints the flow table and the
  verdict per group first (`check_config(keep_refused=True)`), then this refusal.

Per-name BF16 lists (``quantization_ignored_layer_kws``) are part of the recipe now
(`nemo_jetrl.config.layer_lists`); a word naming something outside the flow is refused there.

Only configs with FP8 on some side are refused (a BF16 MoE run has nothing to align).
"""

from __future__ import annotations

import json
import re
from typing import Any

from nemo_jetrl.config import ConfigIssue
from nemo_jetrl.config import schema as S
from nemo_jetrl.recipe import Recipe

EXPERT_LAYERS = "mlp.experts.*.{gate,up,down}_proj, the router mlp.gate and shared experts"
# Megatron keys whose value > 1 (or set) means experts.
_MOE_KEYS = (
    "policy.megatron_cfg.expert_model_parallel_size",
    "policy.megatron_cfg.expert_tensor_parallel_size",
    "policy.megatron_cfg.num_moe_experts",
)
# config.json keys that count experts (HF Mixtral/Qwen-MoE/DeepSeek/MiniMax spellings).
_HF_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# Model families that are MoE: "<N>B-A<M>B" active-parameter names (Qwen3-30B-A3B,
# Moonlight-16B-A3B), DeepSeek-V2/V3/R1 (not the dense R1-Distill models), Mixtral, MiniMax,
# gpt-oss, GLM-4.5, Kimi-K2.
_MOE_NAME = re.compile(
    r"\d+(\.\d+)?B-A\d+(\.\d+)?B|deepseek-(v2|v3|r1)(?!-distill)|mixtral|minimax|gpt-oss|glm-4\.5|kimi-k2",
    re.IGNORECASE,
)


def _select(cfg: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(cfg, key, default=None)
    except Exception:  # an unresolvable value is validation's to report
        return None


def moe_evidence(cfg: Any, arch: Any = None) -> list[str]:
    """Why the config's model is mixture-of-experts ("key=value" phrases; empty: dense)."""
    found = []
    moe = getattr(arch, "moe", None)
    if moe is not None:
        found.append(
            f"{arch.name}: {moe.num_experts} routed experts, top-{moe.top_k}, in "
            f"{len(moe.moe_layers)} of {arch.num_layers} layers"
        )
    for key in _MOE_KEYS:
        v = _select(cfg, key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            found.append(f"{key}={v}")
    path = _select(cfg, "jetrl.model_config")
    if isinstance(path, str):
        try:
            with open(path) as f:
                hf = json.load(f)
        except (OSError, ValueError):
            hf = {}  # an unreadable file is reported by the architecture reader
        for k in _HF_EXPERT_KEYS:
            if isinstance(hf.get(k), int) and hf[k] > 1:
                found.append(f"jetrl.model_config {k}={hf[k]}")
    name = _select(cfg, S.MODEL_NAME)
    # A known description settles it; the name is only a hint for models arch cannot describe.
    if arch is None and isinstance(name, str) and _MOE_NAME.search(name):
        found.append(f"{S.MODEL_NAME}={name!r} (a mixture-of-experts family)")
    return found


def unsupported_issues(cfg: Any, recipe: Recipe, arch: Any = None) -> list[ConfigIssue]:
    """Errors for what no backend can run on-policy yet (FP8 MoE experts); ``arch``: the
    model's description, when known."""
    if not (recipe.train.fp8_linears or recipe.rollout.fp8_linears or recipe.kv_fp8):
        return []
    issues = []
    moe = moe_evidence(cfg, arch)
    if moe:
        issues.append(
            ConfigIssue(
                S.MODEL_NAME,
                f"mixture-of-experts model ({'; '.join(moe)}): its expert layers ({EXPERT_LAYERS}) "
                "run through vLLM's FusedMoE FP8 path (its own per-token-group activation "
                "quantizer, not TE's rule), and nemo_jetrl's vLLM patch has no FP8 experts kernel "
                "yet, so Jet-RL cannot make its FP8 rollout on-policy (the experts row of "
                "`jetrl check`'s flow). Use a dense model, or run this one in BF16 "
                f"(policy.generation.vllm_cfg.precision=bfloat16, {S.FP8_ENABLED}=false)",
            )
        )
    return issues
