"""Apply and revert the vLLM patch: one explicit call, a handle, nothing at import time.

``apply_patches(recipe)`` does four things and ``PatchHandle.revert()`` undoes them:

1. checks that the installed vLLM is in a supported range (``compat.SUPPORTED_RANGES``: the patch
   relies on vLLM internals, the block-FP8 kernel registry and the kernel base class, whose
   version-dependent details live in ``compat.py``; outside the ranges it refuses with an error
   that says which versions work);
2. registers our block-FP8 linear kernel first in vLLM's kernel registry of this process
   (``kernel.register_kernel``), so every block-FP8 linear layer quantizes its activations with
   ``nemo_jetrl.fp8`` and runs our GEMM; on vLLM 0.32.x it also makes ``Fp8Config`` build our
   experts method for block-FP8 MoE layers (``experts.install_moe_method``; on other versions
   the guard refuses vLLM's own FP8 expert kernels);
3. refuses (``guard.KernelGuardError``, naming the setting; registry restored) an environment
   in which vLLM would run block-FP8 linears without our kernel: our plugin's entry point missing
   or not loadable, ``VLLM_PLUGINS`` without it, ``VLLM_DISABLED_KERNELS`` naming our kernel;
4. sets ``NEMO_JETRL_VLLM_PATCH`` (the settings as JSON) in the environment. vLLM starts its
   engine-core and worker processes itself and loads ``vllm.general_plugins`` entry points in
   each; ours (``plugin.load_in_worker``) applies step 2 there only when this variable is set.
   So the patch reaches exactly the engines created while it is applied. That it did is checked
   after start by ``guard.verify_engine_kernels`` (``VllmRolloutEngine`` calls it).

Applying twice with the same settings is a no-op that returns an equivalent handle; applying with
different settings while applied is refused. ``revert()`` is idempotent. Engines created while
the patch was applied keep their kernels (their layers were built with them); engines created
after ``revert()`` are plain vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from nemo_jetrl._optional import require
from nemo_jetrl.vllm_patch import compat, guard
from nemo_jetrl.vllm_patch.settings import ENV_VAR, PatchSettings, settings_from_recipe


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is outside the ranges the patch was written and tested for."""


class PatchConflict(RuntimeError):
    """The patch is already applied with different settings."""


def supported_range() -> str:
    """The supported vLLM versions, e.g. '>=0.20.0,<0.20.1 or ... or >=0.32.0,<0.33.1'."""
    return compat.supported_range()


def check_vllm_version(version: str) -> None:
    """Raise UnsupportedVllmVersion unless ``version`` is in a supported range."""
    try:
        ok = compat.is_supported(version)
    except ValueError as exc:
        raise UnsupportedVllmVersion(str(exc)) from None
    if not ok:
        raise UnsupportedVllmVersion(
            f"nemo_jetrl.vllm_patch supports vLLM {supported_range()}, but vLLM {version} is "
            "installed. The patch relies on vLLM internals (the block-FP8 kernel registry) that "
            "change between releases. Install a supported version (CPU: bash "
            "scripts/setup_vllm_env.sh, with VLLM_VERSION=0.20.0 or 0.25.1 for those; GPU: "
            "the Docker image) or leave the patch off (jetrl.vllm_patch: false), which makes "
            "the rollout quantizer vLLM's own (off-policy with FP32 scales)."
        )


@dataclass
class PatchHandle:
    """What ``apply_patches`` changed; ``revert()`` (or leaving the ``with`` block) undoes it."""

    settings: PatchSettings
    vllm_version: str
    _reverted: bool = field(default=False, repr=False)

    @property
    def active(self) -> bool:
        return not self._reverted and os.environ.get(ENV_VAR) == self.settings.to_json()

    def revert(self) -> None:
        """Remove our kernel from vLLM's registry and clear the environment variable."""
        if self._reverted:
            return
        from nemo_jetrl.vllm_patch.experts import uninstall_moe_method
        from nemo_jetrl.vllm_patch.kernel import unregister_kernel

        unregister_kernel()
        uninstall_moe_method()
        if os.environ.get(ENV_VAR) == self.settings.to_json():
            del os.environ[ENV_VAR]
        self._reverted = True

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.revert()


def apply_in_process(settings: PatchSettings) -> type:
    """Register our kernel in this process's vLLM (used by apply_patches and by the plugin)."""
    vllm = require("vllm", feature="nemo_jetrl.vllm_patch")
    check_vllm_version(vllm.__version__)
    from nemo_jetrl.vllm_patch.experts import install_moe_method, moe_supported
    from nemo_jetrl.vllm_patch.kernel import register_kernel

    cls = register_kernel(settings)
    if settings.fp8_weights and moe_supported(vllm.__version__):
        install_moe_method(settings)  # other versions: the guard refuses vLLM's own MoE kernels
    return cls


def apply_patches(recipe: Any, *, num_layers: int | None = None) -> PatchHandle:
    """Patch vLLM (this process and engines started from now on) for ``recipe``.

    ``recipe`` is a ``nemo_jetrl.recipe.Recipe`` or a ``PatchSettings``. Returns a handle; use it
    as a context manager or call ``revert()``.
    """
    settings = settings_from_recipe(recipe, num_layers=num_layers)
    vllm = require("vllm", feature="nemo_jetrl.vllm_patch")
    check_vllm_version(vllm.__version__)
    current = os.environ.get(ENV_VAR)
    if current is not None and current != settings.to_json():
        raise PatchConflict(
            f"the nemo_jetrl vLLM patch is already applied with other settings ({ENV_VAR}="
            f"{current}); revert that handle first (or unset {ENV_VAR} if it leaked in from a "
            "parent process)"
        )
    from nemo_jetrl.vllm_patch.kernel import registered_kernel, unregister_kernel

    was_registered = registered_kernel() is not None
    cls = apply_in_process(settings)
    try:
        guard.check_before_start(settings, cls.__name__)
    except guard.KernelGuardError:
        if not was_registered:
            from nemo_jetrl.vllm_patch.experts import uninstall_moe_method

            unregister_kernel()  # leave the registry (and vLLM's MoE method) as we found them
            uninstall_moe_method()
        raise
    os.environ[ENV_VAR] = settings.to_json()
    return PatchHandle(settings=settings, vllm_version=vllm.__version__)
