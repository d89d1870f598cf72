"""What the precision flow cannot describe, refused by name before any verdict.

`check_on_policy` knows dense decoder linears (q/k/v/o, gate/up/down), embeddings, lm_head and
the KV cache. Mixture-of-experts models fall outside it, and `jetrl check` / `align` refuse them
(exit 2) instead of calling them on-policy:

- Mixture-of-experts models: their expert linears (``mlp.experts.*.{gate,up,down}_proj``, with
  the router ``mlp.gate`` and any shared experts) go through vLLM's FusedMoE FP8 path, which
  ``nemo_jetrl.vllm_patch`` does not patch, and the trainer's grouped expert GEMMs, which the
  flow does not draw. Seen from the config: expert parallelism, Megatron's MoE sizes, a
  ``jetrl.model_config`` with experts, or a model name of a known MoE family.

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
# Moonlight-16B-A3B), DeepSeek-V2/V3/R1, Mixtral, MiniMax, gpt-oss, GLM-4.5, Kimi-K2.
_MOE_NAME = re.compile(
    r"\d+(\.\d+)?B-A\d+(\.\d+)?B|deepseek-(v2|v3|r1)|mixtral|minimax|gpt-oss|glm-4\.5|kimi-k2",
    re.IGNORECASE,
)


def _select(cfg: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(cfg, key, default=None)
    except Exception:  # an unresolvable value is validation's to report
        return None


def moe_evidence(cfg: Any) -> list[str]:
    """Why the config's model is mixture-of-experts ("key=value" phrases; empty: dense)."""
    found = []
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
    if isinstance(name, str) and _MOE_NAME.search(name):
        found.append(f"{S.MODEL_NAME}={name!r} (a mixture-of-experts family)")
    return found


def unsupported_issues(cfg: Any, recipe: Recipe) -> list[ConfigIssue]:
    """Errors for what the flow check cannot cover (MoE experts)."""
    if not (recipe.train.fp8_linears or recipe.rollout.fp8_linears or recipe.kv_fp8):
        return []
    issues = []
    moe = moe_evidence(cfg)
    if moe:
        issues.append(
            ConfigIssue(
                S.MODEL_NAME,
                f"mixture-of-experts model ({'; '.join(moe)}): its expert layers ({EXPERT_LAYERS}) "
                "run through vLLM's FusedMoE FP8 path, which nemo_jetrl's vLLM patch does not "
                "cover, so Jet-RL cannot make its FP8 rollout on-policy. Use a dense model, or "
                "run this one in BF16 (policy.generation.vllm_cfg.precision=bfloat16, "
                f"{S.FP8_ENABLED}=false)",
            )
        )
    return issues
