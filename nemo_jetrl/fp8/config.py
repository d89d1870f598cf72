"""Configuration of FP8 linear layers under Transformer Engine's blockwise recipe.

TE's ``Float8BlockScaling`` fixes the block shapes; what a user chooses is the element format of
the backward pass (``e4m3`` everywhere, or ``hybrid`` = E5M2 gradients), the scale mode
(power-of-two, TE's default, or FP32 via ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``) and, in this
emulation, which GEMM path to use. A config is frozen: the same object describes the trainer and
the rollout, so nothing may drift between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from nemo_jetrl.fp8 import spec
from nemo_jetrl.fp8.formats import E4M3, RECIPE_FORMATS, Fp8Format, grad_format
from nemo_jetrl.fp8.spec import Block


@dataclass(frozen=True)
class Fp8LinearConfig:
    """How an FP8 linear layer quantizes (TE ``Float8BlockScaling`` semantics)."""

    fmt: str = "e4m3"
    """Recipe format: ``"e4m3"`` (E4M3 for all tensors) or ``"hybrid"`` (E4M3 forward,
    E5M2 for gradients in the backward pass). TE's ``fp8_format``."""

    pow2_scales: bool = True
    """Round each block's scale down to a power of two (TE's default). ``False`` keeps FP32
    scales (TE with ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``)."""

    eps: float = 0.0
    """Lower bound applied to each block's amax before computing the scale (TE's ``amax_epsilon``;
    0 disables it). Must be finite and >= 0."""

    exact_gemm: bool = False
    """``True``: GEMMs accumulate in fp32 per 128-wide K tile with scales applied per tile (the
    TE/DeepGEMM reference, slower on CPU). ``False``: dequantize then one fp32 matmul."""

    # Block shapes are fixed by the TE recipe, not configurable.
    ACTIVATION_BLOCK: ClassVar[Block] = (
        spec.ACTIVATION_BLOCK
    )  # FProp x, DGrad dY: per token along K
    WEIGHT_BLOCK: ClassVar[Block] = spec.WEIGHT_BLOCK  # W, reused transposed for DGrad
    WGRAD_BLOCK: ClassVar[Block] = spec.WGRAD_BLOCK  # WGrad x and dY: 128 tokens per block
    # fused experts' N and K must be multiples of this (their blocks stack per expert); a plain
    # linear follows `spec.linear_dims_problem` (partial blocks allowed)
    DIM_MULTIPLE: ClassVar[int] = spec.BLOCK

    def __post_init__(self) -> None:
        errors = []
        if self.fmt not in RECIPE_FORMATS:
            errors.append(f"fmt={self.fmt!r}: use one of {list(RECIPE_FORMATS)}")
        if not isinstance(self.pow2_scales, bool):
            errors.append(f"pow2_scales={self.pow2_scales!r}: must be true or false")
        if not isinstance(self.eps, (int, float)) or not math.isfinite(self.eps) or self.eps < 0:
            errors.append(f"eps={self.eps!r}: must be a finite number >= 0")
        if not isinstance(self.exact_gemm, bool):
            errors.append(f"exact_gemm={self.exact_gemm!r}: must be true or false")
        if errors:
            raise ValueError("invalid Fp8LinearConfig: " + "; ".join(errors))

    @property
    def forward_format(self) -> Fp8Format:
        """Format of activations and weights (E4M3 under both recipe formats)."""
        return E4M3

    @property
    def grad_format(self) -> Fp8Format:
        """Format of output gradients in the backward pass (E5M2 under ``hybrid``)."""
        return grad_format(self.fmt)

    @classmethod
    def te_blockwise(cls, **overrides) -> Fp8LinearConfig:
        """TE ``Float8BlockScaling()`` defaults: E4M3 everywhere, power-of-two scales."""
        return cls(**{"fmt": "e4m3", "pow2_scales": True, **overrides})

    @classmethod
    def te_blockwise_fp32_scales(cls, **overrides) -> Fp8LinearConfig:
        """TE blockwise with ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` (NeMo-RL's FP8 recipe)."""
        return cls(**{"fmt": "e4m3", "pow2_scales": False, **overrides})

    @classmethod
    def te_blockwise_hybrid(cls, **overrides) -> Fp8LinearConfig:
        """TE blockwise with ``fp8_format=HYBRID``: E5M2 gradients, power-of-two scales."""
        return cls(**{"fmt": "hybrid", "pow2_scales": True, **overrides})
