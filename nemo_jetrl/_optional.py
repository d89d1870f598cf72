"""Lazy imports of optional heavy dependencies, with an error that says what to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from nemo_jetrl.errors import MissingDependencyError

__all__ = ["MissingDependencyError", "available", "require"]

# module -> how a user gets it
_INSTALL_HINTS = {
    "torch": "pip install torch -c constraints-cpu.txt (the CPU build is enough)",
    "vllm": "bash scripts/setup_vllm_env.sh (vLLM lives in its own environment, .venv-vllm)",
    "megatron.core": "pip install 'nemo-jetrl[megatron]' -c constraints-cpu.txt",
    "transformer_engine": "use the Docker image (docker/Dockerfile); TE needs CUDA to build",
    "nemo_rl": "use the Docker image (docker/Dockerfile), which is built on the NeMo-RL container",
    "transformers": "pip install 'nemo-jetrl[local]' -c constraints-cpu.txt",
    "tensorboard": "pip install 'nemo-jetrl[logs]' -c constraints-cpu.txt",
    "matplotlib": "pip install 'nemo-jetrl[logs]' -c constraints-cpu.txt",
}


def require(module: str, *, feature: str) -> ModuleType:
    """Import `module` or raise MissingDependencyError naming `feature` and the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        hint = _INSTALL_HINTS.get(module) or _INSTALL_HINTS.get(top) or f"pip install {top}"
        raise MissingDependencyError(
            f"{feature} needs the optional dependency '{module}', which could not be imported "
            f"({exc}). Install it with: {hint}"
        ) from exc


def available(module: str) -> bool:
    """True when `module` imports (never raises)."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True
