"""FP8 numerics: formats, blockwise quantization, layouts, reference GEMM and the FP8 linear.

Depends on torch only. Everything that is FP8 on either side of an RL step goes through
`quantize_blockwise`, so training and rollout see the same bits.
"""

from nemo_jetrl.fp8.formats import E4M3, E5M2, FORMATS, Fp8Format, get_format, grad_format
from nemo_jetrl.fp8.quantize import (
    BLOCKS,
    BlockQuantized,
    cast_to_fp8,
    compute_scale,
    fp8_bits,
    quantize_blockwise,
)

__all__ = [
    "BLOCKS",
    "E4M3",
    "E5M2",
    "FORMATS",
    "BlockQuantized",
    "Fp8Format",
    "cast_to_fp8",
    "compute_scale",
    "fp8_bits",
    "get_format",
    "grad_format",
    "quantize_blockwise",
]
