"""The vLLM workers' environment, judged in the driver before Ray starts (`worker_env_problems`):
what NeMo-RL's worker groups will hand the vLLM processes (the launch environment, overridden by
``policy.generation.vllm_cfg.env_vars``) and what each setting would do to our plugins, kernel
and weights. The engine's own report after start is `engine_check`'s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_jetrl.backends.nemo_rl.engine_check import REFIT_PLUGIN


def _listed(value: str | None) -> list[str] | None:
    """A comma-separated vLLM variable as vLLM parses it (None: unset)."""
    return None if value is None else [p.strip() for p in value.split(",") if p.strip()]


def _truthy(value: str | None) -> bool:
    """A vLLM boolean variable as vLLM reads it (unset: False here; "0"/"false": False)."""
    return value is not None and value.strip().lower() not in ("", "0", "false")


def worker_env_problems(
    environ: Mapping[str, str], env_vars: Mapping[str, Any], hook_expected: bool
) -> list[str]:
    """Before Ray: what the vLLM workers' environment (this process's, which NeMo-RL's worker
    groups copy, under ``policy.generation.vllm_cfg.env_vars``) would do to our plugins and
    kernel. Each problem names the variable and where it was set."""
    from nemo_jetrl.backends.nemo_rl.translate import DEEP_GEMM_E8M0_ENV, VLLM_PATCH_ENV
    from nemo_jetrl.vllm_patch.guard import env_problems
    from nemo_jetrl.vllm_patch.settings import KERNEL_NAME

    def where(key: str) -> tuple[str | None, str]:
        if key in env_vars:
            return str(env_vars[key]), f"policy.generation.vllm_cfg.env_vars.{key}"
        return environ.get(key), f"{key} in the launch environment"

    plugins, p_src = where("VLLM_PLUGINS")
    disabled, d_src = where("VLLM_DISABLED_KERNELS")
    out = [
        f"{msg} (set by {p_src if msg.startswith('VLLM_PLUGINS') else d_src})"
        for msg in env_problems(KERNEL_NAME, _listed(plugins), _listed(disabled) or [])
    ]
    e8m0, e_src = where(DEEP_GEMM_E8M0_ENV)
    if VLLM_PATCH_ENV in env_vars and _truthy(e8m0):
        out.append(
            f"{DEEP_GEMM_E8M0_ENV}={e8m0} (set by {e_src}): on Hopper and Blackwell NeMo-RL's FP8 "
            "weight loading (precision: fp8) then re-quantizes every FP8 weight in the engine "
            "to DeepGEMM's UE8M0 scales, so the rollout would not run the trainer's weights "
            "(the refit parity check fails at the first refit): remove it (the launch sets 0)"
        )
    listed = _listed(plugins)
    if hook_expected and listed is not None and REFIT_PLUGIN not in listed:
        out.append(
            f"VLLM_PLUGINS={plugins!r} does not list {REFIT_PLUGIN!r} (set by {p_src}), so "
            "NeMo-RL's refit would quantize with its own code: add it or unset VLLM_PLUGINS"
        )
    return out
