"""The rehearsal's stand-in for vLLM's block-FP8 GEMM kernels, on a CPU that has none.

A recipe that serves block-FP8 with vLLM's own code (``fp8_rollout``, and NeMo-RL's shipped
FP8 configs) builds each linear's kernel from vLLM's per-platform registry
(``_POSSIBLE_FP8_BLOCK_KERNELS``). Its kernels are GPU code (DeepGEMM, CUTLASS, Triton,
FlashInfer); vLLM 0.20 has no CPU entry at all (the engine dies with ``KeyError:
PlatformEnum.CPU``) and 0.25's CPU kernel needs AMX.

`make_class` subclasses vLLM's own ``Fp8BlockScaledMMLinearKernel`` and replaces only its GEMM
(``apply_block_scaled_mm``): vLLM's activation quantizer (``QuantFP8``, built by the parent),
its weight processing and its ``apply_weights`` run as on a GPU. The GEMM is the reference one
(`nemo_jetrl.fp8.gemm.blockwise_matmul`: both operands dequantized per block, one fp32 matmul),
so the rollout's numbers are vLLM's quantization of the activations, as on the cluster, up to
the GEMM's accumulation order. `register` appends it LAST to the CPU platform's list: a kernel
vLLM has for this CPU (0.25's AMX one) still wins, and our jetrl kernel (first) is never
displaced. The class name says what it is in vLLM's "Selected ... for Fp8LinearMethod" line.
"""

from __future__ import annotations

from typing import Any

MARKER = "_nemo_jetrl_rehearsal_gemm"
CLASS_NAME = "RehearsalCpuBlockFp8Kernel"


def make_class() -> type:
    """vLLM's ``Fp8BlockScaledMMLinearKernel`` with the reference GEMM (needs vLLM)."""
    import torch

    from nemo_jetrl.fp8.gemm import blockwise_matmul
    from nemo_jetrl.fp8.quantize import BlockQuantized
    from nemo_jetrl.fp8.spec import ACTIVATION_BLOCK, WEIGHT_BLOCK
    from nemo_jetrl.vllm_patch import compat

    base, _ = compat.kernel_base_classes()

    class Kernel(base):  # type: ignore[misc, valid-type]
        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return True, None

        @classmethod
        def can_implement(cls, config: Any) -> tuple[bool, str | None]:
            ok, why = super().can_implement(config)
            if not ok:
                return ok, why
            act, wgt = config.activation_quant_key.scale, config.weight_quant_key.scale
            shapes = ((act.group_shape.row, act.group_shape.col),
                      (wgt.group_shape.row, wgt.group_shape.col))  # fmt: skip
            if shapes != (ACTIVATION_BLOCK, WEIGHT_BLOCK):
                return False, f"{CLASS_NAME}: 1x128 activations and 128x128 weights only"
            return True, None

        def apply_block_scaled_mm(self, A: Any, B: Any, As: Any, Bs: Any) -> Any:
            a = BlockQuantized(A, As.float(), ACTIVATION_BLOCK, "e4m3", False)
            b = BlockQuantized(B, Bs.float(), WEIGHT_BLOCK, "e4m3", False)
            return blockwise_matmul(a, b, out_dtype=torch.float32).to(self.config.out_dtype)

    Kernel.__name__ = Kernel.__qualname__ = CLASS_NAME
    setattr(Kernel, MARKER, True)
    return Kernel


def register() -> tuple[type, Any]:
    """Append the stand-in to this platform's block-FP8 list (created if vLLM has none);
    returns (class, undo). ``undo`` removes it and any list it created."""
    from nemo_jetrl.vllm_patch import compat

    reg = compat.fp8_block_registry()
    key = compat.current_platform_key()
    created = key not in reg
    cls = make_class()
    reg.setdefault(key, []).append(cls)

    def undo() -> None:
        kernels = reg.get(key, [])
        if cls in kernels:
            kernels.remove(cls)
        if created and not kernels:
            reg.pop(key, None)

    return cls, undo


def registered() -> bool:
    """The stand-in is in this platform's list."""
    from nemo_jetrl.vllm_patch import compat

    kernels = compat.fp8_block_registry().get(compat.current_platform_key(), [])
    return any(getattr(c, MARKER, False) for c in kernels)
