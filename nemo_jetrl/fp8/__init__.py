"""FP8 numerics: formats, blockwise quantization, layouts, reference GEMM and the FP8 linear.

Start here (reading order): ``spec`` (block shapes), ``formats`` (E4M3/E5M2), ``quantize`` (the
pure reference quantizer and its math), ``dispatch`` (``quantize_blockwise``: Triton or the
reference, chosen explicitly; the FP8 GEMM backends), ``gemm``, ``config``, ``linear``,
``convert``; then ``layouts``, ``vllm_native``, ``triton_kernels``, ``gemm_backends`` (which
GEMM runs, decided once), ``gemm_layouts`` (the rows and scale layouts each reads) and ``triton_gemm``, ``sync_check`` (host-read detector for tests). Outside ``fp8/``:
``recipe.py``, then ``flow/pipeline.py``.

Depends on torch only. Everything that is FP8 on either side of an RL step goes through
`quantize_blockwise`, so training and rollout see the same bits.

Modules: ``formats`` (E4M3/E5M2), ``quantize`` (the one quantizer), ``gemm`` (blockwise-scaled
GEMM), ``config`` (``Fp8LinearConfig``), ``linear`` (``Fp8BlockLinear``, ``Fp8InferenceLinear``),
``convert`` (module swap), ``graphed`` (a linear's training step in CUDA graphs), ``experts`` (grouped MoE expert linear: ``grouped_fp8_linear``,
``quantize_expert_weights``, ``grouped_fp8_linear_inference``; reference ``experts_reference``,
GPU path ``triton_grouped``), ``layouts`` (TE / vLLM / DeepGEMM storage), ``vllm_native``
(emulation of an unpatched vLLM's own quantizers, for off-policy baselines).
"""

import importlib
from typing import Any

# public name -> the module that defines it; loaded on first use, so importing
# ``nemo_jetrl.fp8.spec`` (plain numbers) does not load torch.
_EXPORTS = {
    "BLOCKS": "spec",
    "E4M3": "formats",
    "E5M2": "formats",
    "FORMATS": "formats",
    "BlockQuantized": "quantize",
    "ConversionReport": "convert",
    "Fp8BlockLinear": "linear",
    "Fp8Format": "formats",
    "Fp8InferenceLinear": "inference_linear",
    "Fp8LinearConfig": "config",
    "GraphedLinear": "graphed",
    "GroupedQuantizedWeights": "grouped_tensors",
    "blockwise_matmul": "gemm",
    "cast_to_fp8": "quantize",
    "check_non_finite": "finite_flags",
    "compute_scale": "quantize",
    "convert_to_fp8_inference": "convert",
    "convert_to_fp8_training": "convert",
    "fp8_bits": "quantize",
    "get_format": "formats",
    "grad_format": "formats",
    "graph_linear": "graphed",
    "grouped_fp8_linear": "experts",
    "grouped_fp8_linear_inference": "experts",
    "load_expert_weights": "experts",
    "quantize_blockwise": "dispatch",
    "quantize_expert_weights": "experts",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "BLOCKS",
    "E4M3",
    "E5M2",
    "FORMATS",
    "BlockQuantized",
    "ConversionReport",
    "Fp8BlockLinear",
    "Fp8Format",
    "Fp8InferenceLinear",
    "Fp8LinearConfig",
    "GraphedLinear",
    "GroupedQuantizedWeights",
    "blockwise_matmul",
    "cast_to_fp8",
    "check_non_finite",
    "compute_scale",
    "convert_to_fp8_inference",
    "convert_to_fp8_training",
    "fp8_bits",
    "get_format",
    "grad_format",
    "graph_linear",
    "grouped_fp8_linear",
    "grouped_fp8_linear_inference",
    "load_expert_weights",
    "quantize_blockwise",
    "quantize_expert_weights",
]
