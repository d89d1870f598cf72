"""Block shapes of blockwise FP8: the one home of these numbers for the whole package.

Plain Python (no torch): `recipe`, `arch`, `vllm_patch.settings` and `megatron.export` import
them without loading the numerics (``nemo_jetrl.fp8`` loads its modules on first use).
"""

from __future__ import annotations

Block = tuple[int, int]

#: The block edge of blockwise FP8 (TE Float8BlockScaling, vLLM block-quantized linears,
#: DeepGEMM). A dim that is not a multiple of it ends in a partial block: scale grids are
#: ceil-sized and a partial block's amax is over its valid elements (padding never counts).
BLOCK = 128
#: TE's FP8 GEMM rule for a linear's weight ``[out, in]`` (``assert_dim_for_fp8_exec``,
#: transformer_engine.pytorch.utils, TE 2.20): ``in % 16 == 0`` and ``out % 8 == 0``. What a
#: blockwise-FP8 linear needs besides: nothing (partial blocks run; multiples of 128 run fastest).
LINEAR_IN_MULTIPLE = 16
LINEAR_OUT_MULTIPLE = 8


def linear_dims_problem(in_features: int, out_features: int) -> str | None:
    """Why a linear of these dims cannot run blockwise FP8 under TE's rule (None: it can)."""
    bad = [f"{what}={v} is not a multiple of {mult}"
           for what, v, mult in (("in_features", in_features, LINEAR_IN_MULTIPLE),
                                 ("out_features", out_features, LINEAR_OUT_MULTIPLE)) if v % mult]  # fmt: skip
    if not bad:
        return None
    return " and ".join(bad) + " (Transformer Engine's FP8 GEMM rule; partial 128-blocks are fine)"


#: FProp x, DGrad dY: one scale per token along K.
ACTIVATION_BLOCK: Block = (1, BLOCK)
#: Weights (reused transposed for DGrad).
WEIGHT_BLOCK: Block = (BLOCK, BLOCK)
#: WGrad x and dY: 128 tokens of one channel per scale.
WGRAD_BLOCK: Block = (BLOCK, 1)
#: Every block shape the quantizer accepts.
BLOCKS: tuple[Block, ...] = (ACTIVATION_BLOCK, WEIGHT_BLOCK, WGRAD_BLOCK)
