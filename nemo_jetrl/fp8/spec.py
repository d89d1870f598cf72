"""Block shapes of blockwise FP8: the one home of these numbers for the whole package.

Plain Python (no torch): `recipe`, `arch`, `vllm_patch.settings` and `megatron.export` import
them without loading the numerics (``nemo_jetrl.fp8`` loads its modules on first use).
"""

from __future__ import annotations

Block = tuple[int, int]

#: Blockwise FP8 needs every GEMM dimension to be a multiple of this (TE Float8BlockScaling,
#: vLLM block-quantized linears, DeepGEMM).
BLOCK = 128
#: FProp x, DGrad dY: one scale per token along K.
ACTIVATION_BLOCK: Block = (1, BLOCK)
#: Weights (reused transposed for DGrad).
WEIGHT_BLOCK: Block = (BLOCK, BLOCK)
#: WGrad x and dY: 128 tokens of one channel per scale.
WGRAD_BLOCK: Block = (BLOCK, 1)
#: Every block shape the quantizer accepts.
BLOCKS: tuple[Block, ...] = (ACTIVATION_BLOCK, WEIGHT_BLOCK, WGRAD_BLOCK)
