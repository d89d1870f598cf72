"""TEST STAND-IN for a CUDA machine: runs a vLLM release's own block-FP8 kernel registry and
selection code, with our patch applied, where only its CUDA wheel exists (vLLM 0.33.0).

Usage: ``python vllm_cuda_selection_probe.py SRC_DIR`` (SRC_DIR from scripts/fetch_vllm_src.sh);
prints one JSON object. SRC_DIR goes first on ``sys.path``, so ``import vllm`` is that release's
Python code (its compiled ``vllm._C`` is absent; nothing here calls it). The stand-in is
``CudaPlatformStandin``, a plain ``vllm.platforms.interface.Platform`` subclass installed as
``vllm.platforms.current_platform``: it is *not* vLLM's ``CudaPlatform`` (which needs a GPU
driver). While vLLM's modules import it reports ``PlatformEnum.OOT``, so import-time probes of
CUDA kernels (``torch.ops._C...``) take their no-CUDA branch; then it reports
``PlatformEnum.CUDA`` with compute capability 9.0, so the registry lookups, ``apply_patches`` and
the selection run for CUDA. Kernel classes are selected, never instantiated (that would need a GPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys


def _install_standin():
    import vllm.platforms as platforms
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

    class CudaPlatformStandin(Platform):
        """Stand-in for vLLM's CUDA platform (see the module docstring)."""

        _enum = PlatformEnum.OOT
        device_name = "cuda"
        device_type = "cuda"

        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(9, 0)

    standin = CudaPlatformStandin()
    platforms._current_platform = standin
    platforms.current_platform = standin
    return CudaPlatformStandin


def _names(classes) -> list[str]:
    return [c.__name__ for c in classes]


def main(src: str) -> dict:
    sys.path.insert(0, src)
    import vllm

    standin = _install_standin()
    import torch
    import vllm.model_executor.kernels.linear as kl
    from vllm.config import KernelConfig, VllmConfig, set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
        FP8ScaledMMLinearLayerConfig,
    )
    from vllm.model_executor.layers.quantization.utils import quant_utils as qu
    from vllm.platforms import PlatformEnum

    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import KernelGuardError, apply_patches, compat

    standin._enum = PlatformEnum.CUDA
    reg = kl._POSSIBLE_FP8_BLOCK_KERNELS
    out: dict = {"vllm_version": vllm.__version__, "vllm_file": vllm.__file__}
    out["cuda_before"] = _names(reg[PlatformEnum.CUDA])
    layer = FP8ScaledMMLinearLayerConfig(  # a block-FP8 linear as Fp8LinearMethod describes it
        weight_quant_key=qu.kFp8Static128BlockSym,
        activation_quant_key=qu.kFp8Dynamic128Sym,
        weight_shape=(512, 256),
        input_dtype=torch.bfloat16,
        out_dtype=torch.bfloat16,
    )
    key = compat.FP8_BLOCK_QUANT_KEY

    def resolved(kernel_config):
        with set_current_vllm_config(VllmConfig(kernel_config=kernel_config)):
            return _names(
                kl._resolve_backend_kernels(list(reg[PlatformEnum.CUDA]), "t", quantization=key)
            )

    with apply_patches(Recipe.preset("jetrl")):
        out["cuda_patched"] = _names(reg[PlatformEnum.CUDA])
        ours = reg[PlatformEnum.CUDA][0]
        out["ours_supported"] = kl.is_supported_and_can_implement_kernel(ours, layer, 90)
        os.environ["VLLM_DISABLED_KERNELS"] = ours.__name__  # set after the driver's check
        out["ours_supported_disabled"] = kl.is_supported_and_can_implement_kernel(ours, layer, 90)
        del os.environ["VLLM_DISABLED_KERNELS"]
        with set_current_vllm_config(VllmConfig(kernel_config=KernelConfig())):
            chosen = kl.choose_scaled_mm_linear_kernel(layer, reg, quantization=key)
        out["chosen_auto"] = chosen.__name__
        out["resolved_cutlass"] = resolved(KernelConfig(linear_backend="cutlass"))
        out["resolved_per_quant_cutlass"] = resolved(
            KernelConfig(linear_backend_per_quant={key: "cutlass"})
        )
        out["resolved_per_quant_other_scheme"] = resolved(
            KernelConfig(linear_backend_per_quant={"fp8_w8a8": "cutlass"})
        )
    out["cuda_reverted"] = _names(reg[PlatformEnum.CUDA])
    os.environ["VLLM_DISABLED_KERNELS"] = "JetRLFp8BlockLinearKernel"
    try:
        apply_patches(Recipe.preset("jetrl"))
        out["disabled_refusal"] = None
    except KernelGuardError as exc:
        out["disabled_refusal"] = str(exc)
    del os.environ["VLLM_DISABLED_KERNELS"]
    out["cuda_after_refusal"] = _names(reg[PlatformEnum.CUDA])
    # The engine arguments the guard reads exist under these names in this release.
    out["engine_args_fields"] = sorted(
        {f.name for f in dataclasses.fields(EngineArgs)} & {"linear_backend", "kernel_config"}
    )
    out["kernel_config_fields"] = sorted(
        {f.name for f in dataclasses.fields(KernelConfig)}
        & {"linear_backend", "linear_backend_per_quant"}
    )
    return out


if __name__ == "__main__":
    print("PROBE-RESULT " + json.dumps(main(sys.argv[1])))
