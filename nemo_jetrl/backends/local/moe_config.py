"""The config rules of an MoE run on the local backend, checked before any work starts.

Read from the YAML (NeMo-RL's key ``policy.router_replay.enabled``, ``jetrl.local.*``) and the
model's config.json (``jetrl.local.model_config``). Refused, each naming the key to change:

- ``policy.router_replay.enabled`` true for a dense model (not true/false: the typed schema);
- an MoE model other than Qwen3-MoE with ``jetrl.local.rollout_engine: vllm`` (the expert
  names it sends are Qwen3-MoE checkpoint names);
- ``policy.router_replay.enabled`` with ``jetrl.local.rollout_engine: vllm`` where the installed
  vLLM's routing cannot be recorded (`nemo_jetrl.vllm_patch.routing_capture.capture_problem`);
- an MoE config.json with ``num_experts_per_tok`` outside [1, experts], Mixtral's
  ``router_jitter_noise`` above 0 (random routing in training forwards), an activation other
  than silu, or ``output_router_logits: true`` (an auxiliary loss nothing here computes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nemo_jetrl.backends.local.model import MODEL_CONFIG_JSON
from nemo_jetrl.backends.local.moe import num_experts
from nemo_jetrl.config import schema as S
from nemo_jetrl.config.load import ConfigIssue
from nemo_jetrl.config.settings import Settings

ROUTER_REPLAY_KEY = S.ROUTER_REPLAY


def router_replay_enabled(settings: Settings) -> bool:
    """NeMo-RL's ``policy.router_replay.enabled`` (absent: false)."""
    return settings.moe.router_replay is True


def _model_json(settings: Settings) -> tuple[str, dict[str, Any] | None]:
    p = settings.model.local_config
    path = str(Path(p).expanduser()) if isinstance(p, str) and p else str(MODEL_CONFIG_JSON)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return path, None  # the local section's own check names an unreadable file
    return path, data if isinstance(data, dict) else None


def _engine_capture_problem() -> str | None:
    """Why the installed vLLM's routing cannot be recorded (None: it can, or no vLLM here, which
    the rollout engine's own check reports)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return None
    from nemo_jetrl.vllm_patch.routing_capture import capture_problem

    return capture_problem()


def replay_unrecordable(why: str) -> ConfigIssue:
    """Replay refused because the vLLM engine's routing cannot be recorded (``why``): before the
    run (`moe_run_issues`, from vLLM's code) or at engine start (the engine's own answer)."""
    return ConfigIssue(
        ROUTER_REPLAY_KEY,
        f"routing replay needs the vLLM engine's routed experts, which cannot be recorded here "
        f"({why}): set policy.router_replay.enabled=false or jetrl.local.rollout_engine=hf",
    )


def moe_run_issues(settings: Settings) -> list[ConfigIssue]:
    """Every MoE-related problem of a local run's config (see the module docstring)."""
    issues: list[ConfigIssue] = []
    replay = settings.moe.router_replay  # its type: config.nemo_rl_model.RouterReplay
    path, model = _model_json(settings)
    if model is None:
        return issues
    experts = num_experts(model)
    if not experts:
        if replay is True:
            issues.append(
                ConfigIssue(
                    ROUTER_REPLAY_KEY,
                    f"routing replay needs a mixture-of-experts model, but {path} has no experts; "
                    "set policy.router_replay.enabled=false",
                )
            )
        return issues
    where = "jetrl.local.model_config"
    on_vllm = settings.local.rollout_engine == "vllm"
    if on_vllm and model.get("model_type") != "qwen3_moe":
        issues.append(
            ConfigIssue(
                "jetrl.local.rollout_engine",
                f"{path}: the local vLLM rollout serves Qwen3-MoE checkpoints only (its expert "
                f"names), not model_type {model.get('model_type')!r}: set "
                "jetrl.local.rollout_engine=hf",
            )
        )
    if on_vllm and replay is True:
        why = _engine_capture_problem()
        if why is not None:
            issues.append(replay_unrecordable(why))
    k = model.get("num_experts_per_tok")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= experts:
        issues.append(
            ConfigIssue(
                where,
                f"{path}: num_experts_per_tok={k!r} must be an integer in [1, {experts}] "
                "(the number of experts)",
            )
        )
    jitter = model.get("router_jitter_noise", 0.0)
    if isinstance(jitter, (int, float)) and jitter > 0:
        issues.append(
            ConfigIssue(
                where,
                f"{path}: router_jitter_noise={jitter} makes training forwards route at random "
                "(never the rollout's policy); set it to 0",
            )
        )
    act = model.get("hidden_act", "silu")
    if act != "silu":
        issues.append(
            ConfigIssue(where, f"{path}: hidden_act={act!r}; MoE experts here support silu only")
        )
    if model.get("output_router_logits") is True:
        issues.append(
            ConfigIssue(
                where,
                f"{path}: output_router_logits=true asks HF's forward for a load-balancing loss "
                "the GRPO loss does not use (the swapped MoE blocks do not feed it); set it to "
                "false",
            )
        )
    return issues
