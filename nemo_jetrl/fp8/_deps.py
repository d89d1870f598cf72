"""fp8's own optional imports (triton, deep_gemm): `fp8/` depends on torch and nothing else here."""

from __future__ import annotations

import importlib
from types import ModuleType

_HINTS = {
    "triton": "pip install 'nemo-jetrl[triton]' -c constraints-cpu.txt",
    "deep_gemm": "build DeepGEMM from source inside the Docker image (the PyPI name is a placeholder)",
}


class Fp8DependencyError(ImportError):
    """triton or deep_gemm is missing; the message says how to get it."""


def require(module: str, *, feature: str) -> ModuleType:
    """Import ``module`` or raise `Fp8DependencyError` naming ``feature`` and the install step."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise Fp8DependencyError(
            f"{feature} needs the optional dependency '{module}', which could not be imported "
            f"({exc}). Install it with: {_HINTS.get(module, f'pip install {module}')}"
        ) from exc


def available(module: str) -> bool:
    """True when ``module`` imports (never raises)."""
    try:
        require(module, feature=module)
    except Exception:  # a broken install may raise anything on import
        return False
    return True
