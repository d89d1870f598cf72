"""FP8 numerics: formats, blockwise quantization, layouts, reference GEMM and the FP8 linear.

Depends on torch only. Everything that is FP8 on either side of an RL step goes through
`quantize_blockwise`, so training and rollout see the same bits.

Modules: ``formats`` (E4M3/E5M2), ``quantize`` (the one quantizer), ``gemm`` (blockwise-scaled
GEMM), ``config`` (``Fp8LinearConfig``), ``linear`` (``Fp8BlockLinear``, ``Fp8InferenceLinear``),
``convert`` (module swap), ``layouts`` (TE / vLLM / DeepGEMM storage), ``vllm_native``
(emulation of an unpatched vLLM's own quantizers, for off-policy baselines).
"""

from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.convert import (
    ConversionReport,
    convert_to_fp8_inference,
    convert_to_fp8_training,
)
from nemo_jetrl.fp8.dispatch import quantize_blockwise
from nemo_jetrl.fp8.formats import E4M3, E5M2, FORMATS, Fp8Format, get_format, grad_format
from nemo_jetrl.fp8.gemm import blockwise_matmul
from nemo_jetrl.fp8.linear import Fp8BlockLinear, Fp8InferenceLinear
from nemo_jetrl.fp8.quantize import (
    BLOCKS,
    BlockQuantized,
    cast_to_fp8,
    compute_scale,
    fp8_bits,
)

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
    "blockwise_matmul",
    "cast_to_fp8",
    "compute_scale",
    "convert_to_fp8_inference",
    "convert_to_fp8_training",
    "fp8_bits",
    "get_format",
    "grad_format",
    "quantize_blockwise",
]
