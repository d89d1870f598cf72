"""What no backend can run on-policy yet, refused by name (exit 2).

The flow reads mixture-of-experts models group by group (`nemo_jetrl.arch.moe`: attention,
dense MLP, router, experts, shared experts). Routed experts run our FP8 experts computation on
both sides (`nemo_jetrl.fp8.experts`: TE's grouped linear in training; the local backend's HF
rollout and nemo_jetrl's vLLM experts kernel in the rollout). What is not covered yet, with FP8
on some side, is refused after `jetrl check` prints the flow table and the verdict per group
(`check_config(keep_refused=True)`):

- an MoE model the flow cannot describe (evidence only from Megatron's expert keys or a model
  name of a known MoE family): point ``jetrl.model_config`` at its config.json;
- a vLLM rollout that splits the experts over ranks in a way the experts kernel cannot serve
  with training's FP8 blocks (`_split_gaps`): ``vllm_cfg.tensor_parallel_size`` leaving a
  per-rank expert width that is not a multiple of 128 without expert parallel, or
  ``expert_parallel_size`` above ``tensor_parallel_size`` (vLLM data parallel).

Shared experts (Qwen ``shared_expert`` + ``shared_expert_gate``, DeepSeek/Moonlight
``shared_experts``) are dense linears, drawn with each side's dense quantizer (group "shared
experts"); the local backend refuses them by name when it swaps the MoE blocks
(`backends.local.moe.convert_moe_blocks`: its blocks compute routed experts only).

Which vLLM releases run the experts kernel (0.20, 0.25.1, 0.32) is a per-backend fact
(`flow.backend`). Per-name BF16 lists (``quantization_ignored_layer_kws``) are part of the recipe
(`nemo_jetrl.config.layer_lists`); a word naming something outside the flow is refused there.
Only configs with FP8 on some side are refused (a BF16 MoE run has nothing to align).

A model with state-space (Mamba) layers (`nemo_jetrl.arch.state_space`: Nemotron-H, Nemotron
Nano v2, Nemotron 3) is refused with FP8 whatever else it has (its MoE layers too): its
config.json says so, or its name when no config.json is given.
"""

from __future__ import annotations

import json
import re
from typing import Any

from nemo_jetrl.arch.builtins import model_dir_config
from nemo_jetrl.arch.state_space import (
    MAMBA_LAYERS,
    MAMBA_MIXER,
    name_is_state_space,
    state_space_evidence,
)
from nemo_jetrl.config import ConfigIssue, Settings
from nemo_jetrl.config import schema as S
from nemo_jetrl.recipe import Recipe

EXPERT_LAYERS = "mlp.experts.*.{gate,up,down}_proj, the router mlp.gate and shared experts"
# config.json keys that count experts (HF Mixtral/Qwen-MoE/DeepSeek/MiniMax spellings).
_HF_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# Model families that are MoE: "<N>B-A<M>B" active-parameter names (Qwen3-30B-A3B,
# Moonlight-16B-A3B), DeepSeek-V2/V3/R1 (not the dense R1-Distill models), Mixtral, MiniMax,
# gpt-oss, GLM-4.5, Kimi-K2.
_MOE_NAME = re.compile(
    r"\d+(\.\d+)?B-A\d+(\.\d+)?B|deepseek-(v2|v3|r1)(?!-distill)|mixtral|minimax|gpt-oss|glm-4\.5|kimi-k2",
    re.IGNORECASE,
)


def moe_evidence(settings: Settings, arch: Any = None) -> list[str]:
    """Why the config's model is mixture-of-experts ("key=value" phrases; empty: dense)."""
    found = []
    moe = getattr(arch, "moe", None)
    if moe is not None:
        found.append(
            f"{arch.name}: {moe.num_experts} routed experts, top-{moe.top_k}, in "
            f"{len(moe.moe_layers)} of {arch.num_layers} layers"
        )
    for key, v in settings.moe.megatron_experts:  # Megatron's expert keys: > 1 means experts
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            found.append(f"{key}={v}")
    key, hf = _model_json(settings)  # a model directory is read by `arch` itself
    for k in _HF_EXPERT_KEYS if key == "jetrl.model_config" else ():
        if isinstance(hf.get(k), int) and hf[k] > 1:
            found.append(f"{key} {k}={hf[k]}")
    name = settings.model.name
    # A known description settles it; the name is only a hint for models arch cannot describe.
    if arch is None and isinstance(name, str) and _MOE_NAME.search(name):
        found.append(f"{S.MODEL_NAME}={name!r} (a mixture-of-experts family)")
    return found


def _model_json(settings: Settings) -> tuple[str, dict]:
    """(key, config.json) of ``jetrl.model_config``, else of a local model directory named by
    ``policy.model_name`` ({} when there is none or it cannot be read: an unreadable file is
    reported by the architecture reader)."""
    key, path = "jetrl.model_config", settings.model.config
    if not isinstance(path, str):
        key, found = S.MODEL_NAME, model_dir_config(settings.model.name)
        if found is None:
            return key, {}
        path = str(found)
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return key, {}
    return key, hf if isinstance(hf, dict) else {}


def state_space_model(settings: Settings, arch: Any = None) -> tuple[str, str] | None:
    """(key, "key=value" evidence) when the config's model has state-space layers: Nemotron-H
    described by ``arch`` (its layers counted), else evidence in its config.json or name (None:
    it has none, or a description of another family says what it has)."""
    if arch is not None:
        mamba = getattr(arch, "mamba", None)
        if mamba is None:
            return None
        key = "jetrl.model_config" if settings.model.config else S.MODEL_NAME
        return key, f"{key} model_type={arch.model_type!r}: {mamba.counted()}"
    key, hf = _model_json(settings)
    found = state_space_evidence(hf)
    if found is not None:
        return key, f"{key} {found}"
    name = settings.model.name
    if name_is_state_space(name):
        return S.MODEL_NAME, f"{S.MODEL_NAME}={name!r} (a Mamba hybrid family)"
    return None


_VLLM_TP, _VLLM_EP = S.VLLM_TP, S.VLLM_EP


def _split_gaps(settings: Settings, width: int) -> list[tuple[str, str]]:
    """(key, what) for a vLLM rollout whose experts of ``width`` the experts kernel cannot split
    over ranks with training's FP8 blocks (`vllm_patch.expert_shards`). NeMo-RL: EP > 1 turns
    on vLLM expert parallel (whole experts per rank; EP = TP x vLLM DP); otherwise TP splits each
    expert's width, which keeps training's 1x128/128x128 blocks iff width / TP is a multiple
    of 128 (the partial sums' all-reduce then reorders accumulation, as a dense row-parallel
    linear under TP does)."""
    tp, ep = settings.moe.vllm_tp, settings.moe.vllm_ep  # 1 unless an int > 1
    if ep > tp:
        return [
            (
                _VLLM_EP,
                f"{_VLLM_EP}={ep} > {_VLLM_TP}={tp} runs vLLM data parallel inside the MoE "
                f"layers, which nemo_jetrl's vLLM experts kernel has not run: set {_VLLM_EP}"
                f"={tp} (whole experts per rank) or 1",
            )
        ]
    if ep > 1 or tp == 1 or width % (128 * tp) == 0:
        return []
    fits = [t for t in range(tp - 1, 0, -1) if tp % t == 0 and width % (128 * t) == 0]
    smaller = f" or {_VLLM_TP}={fits[0]} (width / TP a multiple of 128)" if fits else ""
    return [
        (
            _VLLM_TP,
            f"{_VLLM_TP}={tp} splits each expert's width {width} into {width / tp:g} per rank, "
            f"not a multiple of 128: the rollout's FP8 blocks of the experts would not be "
            f"training's. Set {_VLLM_EP}={tp} (vLLM expert parallel: whole experts per "
            f"rank){smaller}",
        )
    ]


def _moe_gaps(settings: Settings, arch: Any) -> list[tuple[str, str]]:
    """(key, what) an FP8 MoE run needs that no backend runs yet (empty: covered)."""
    moe = getattr(arch, "moe", None)
    if moe is None:
        return [
            (
                "jetrl.model_config",
                "the flow has no description of this model's experts: set jetrl.model_config "
                "to its config.json (or use a built-in model name)",
            )
        ]
    # Shared experts are not a gap: dense linears on each side's dense quantizer (vLLM's MoE
    # runner runs them itself around our experts kernel; Megatron's SharedExpertMLP is TE), and
    # Qwen's [1, hidden] shared_expert_gate is BF16 on both (arch.moe.SHARED_GATE_BF16).
    return _split_gaps(settings, moe.expert_size)


def unsupported_issues(settings: Settings, recipe: Recipe, arch: Any = None) -> list[ConfigIssue]:
    """Errors for what no backend can run on-policy yet (parts of FP8 MoE runs); ``arch``: the
    model's description, when known."""
    if not (recipe.train.fp8_linears or recipe.rollout.fp8_linears or recipe.kv_fp8):
        return []
    ssm = state_space_model(settings, arch)
    if ssm is not None:  # its MoE layers add nothing to say
        gap = (
            f"nemo_jetrl reads its layers but has not matched the rollout's and the trainer's "
            f"{MAMBA_MIXER}"
            if arch is not None
            else f"nemo_jetrl does not describe its {MAMBA_LAYERS}"
        )
        return [
            ConfigIssue(
                ssm[0],
                f"model with state-space layers ({ssm[1]}) with FP8: {gap}, so no verdict on it "
                "can be proven (on NeMo-RL, Megatron-Bridge's Nemotron-H provider also keeps its "
                "first and last layer BF16 in training). Run it in BF16 "
                f"({S.VLLM_PRECISION}=bfloat16, {S.FP8_ENABLED}=false, {S.VLLM_KV_DTYPE}=auto)",
            )
        ]
    evidence = moe_evidence(settings, arch)
    if not evidence:
        return []
    return [
        ConfigIssue(
            key,
            f"mixture-of-experts model ({'; '.join(evidence)}) with FP8: {what}. Its expert "
            f"layers ({EXPERT_LAYERS}) cannot be made on-policy this way; or run it in BF16 "
            f"(policy.generation.vllm_cfg.precision=bfloat16, {S.FP8_ENABLED}=false)",
        )
        for key, what in _moe_gaps(settings, arch)
    ]
