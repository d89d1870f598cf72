"""The vLLM workers' environment, judged in the driver before Ray starts (`worker_env_problems`):
what NeMo-RL's worker groups will hand the vLLM processes (the launch environment, overridden by
``policy.generation.vllm_cfg.env_vars``) and what each setting would do to our plugins, kernel
and weights. The engine's own report after start is `engine_check`'s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_jetrl.backends.nemo_rl.engine_check import REFIT_PLUGIN

SPACES = " (vLLM splits it on ',' and keeps spaces: write the names without them)"


def _listed(value: str | None) -> list[str] | None:
    """A comma-separated vLLM variable exactly as vLLM parses it (None: unset): ``envs.py``
    (0.20, 0.25) splits on "," and strips nothing, and the plugin loader matches names exactly,
    so ``"nemo_jetrl, nemo_jetrl_nemo_rl_refit"`` loads the first plugin only."""
    return None if value is None else value.split(",")


def _spaced(value: str | None) -> bool:
    """Whether an entry of the variable carries spaces vLLM keeps in the name."""
    return value is not None and any(p != p.strip() for p in value.split(","))


def _vllm_flag(value: str | None) -> bool | None:
    """A vLLM 0/1 variable as vLLM reads it, ``bool(int(value))`` (``envs.py``, 0.20 and 0.25;
    unset: False here, the launch sets it); None where ``int`` raises ("false", "", "yes"):
    vLLM would raise when it first reads the variable, inside the engine."""
    if value is None:
        return False
    try:
        return bool(int(value))
    except ValueError:
        return None


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
        + (SPACES if _spaced(plugins if msg.startswith("VLLM_PLUGINS") else disabled) else "")
        for msg in env_problems(KERNEL_NAME, _listed(plugins), _listed(disabled) or [])
    ]
    e8m0, e_src = where(DEEP_GEMM_E8M0_ENV)
    flag = _vllm_flag(e8m0)
    if VLLM_PATCH_ENV in env_vars and flag is None:
        out.append(
            f"{DEEP_GEMM_E8M0_ENV}={e8m0!r} (set by {e_src}): vLLM reads it as an integer "
            "(bool(int(value))) and would raise at its first read, in the engine: write 0 or "
            "remove it (the launch sets 0)"
        )
    if VLLM_PATCH_ENV in env_vars and flag:
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
            + (SPACES if _spaced(plugins) else "")
        )
    return out
