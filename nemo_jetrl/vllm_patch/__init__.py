"""vLLM patch: vLLM quantizes exactly as training does (see docs/vllm_patch.md).

Nothing here patches anything at import time. ``apply_patches(recipe)`` returns a handle that
reverts; ``verify_engine_kernels(llm, settings)`` confirms a started engine runs our kernel. vLLM itself is imported lazily, only by the functions that need it.
"""

from nemo_jetrl.vllm_patch.engine import Generation, VllmRolloutEngine
from nemo_jetrl.vllm_patch.engine_args import EngineArgsConflict, EngineKwargs, build_engine_kwargs
from nemo_jetrl.vllm_patch.guard import KernelGuardError, KernelNotInEffect, verify_engine_kernels
from nemo_jetrl.vllm_patch.patch import (
    PatchConflict,
    PatchHandle,
    UnsupportedVllmVersion,
    apply_patches,
    check_vllm_version,
    supported_range,
)
from nemo_jetrl.vllm_patch.settings import PatchSettings, settings_from_recipe

__all__ = [
    "EngineArgsConflict",
    "EngineKwargs",
    "Generation",
    "KernelGuardError",
    "KernelNotInEffect",
    "PatchConflict",
    "PatchHandle",
    "PatchSettings",
    "UnsupportedVllmVersion",
    "VllmRolloutEngine",
    "apply_patches",
    "build_engine_kwargs",
    "check_vllm_version",
    "settings_from_recipe",
    "supported_range",
    "verify_engine_kernels",
]
