"""Blockwise FP8 quantization: the single implementation shared by training and rollout.

For every block (1x128 along the last dim, 128x128, or 128x1 = 128 rows of one column):

    amax      = max |x| over the block (fp32; exact for bf16/fp16/fp32 inputs), then max(amax, eps)
    scale     = 1.0 if amax == 0 else fp32(fmax / amax)      # IEEE round-to-nearest division
                (inf -> finfo(input dtype).max; pow2 mode keeps only sign+exponent bits)
    scale_inv = 1 / scale                                     # what is stored, fp32
    q         = cast_rne_saturating(clamp(fp32(x) * scale, -fmax, fmax))

This is Transformer Engine's formula (multiply by a rounded scale, store its inverse). vLLM's own
FP32-scale path divides by a rounded ``amax / fmax`` instead, which rounds differently; with
power-of-two scales both formulas are exact and agree. Partial blocks at the edges are padded with
zeros for the amax and cropped afterwards. Non-finite input is refused with an error naming the
tensor and the first bad block: an RL run must never ship NaN weights to the rollout engine.
``check_finite=False`` (the serving path: no host sync, CUDA-graph safe) skips that check; every
block holding a non-finite value then gets ``scale_inv = NaN``, so whatever multiplies with it
becomes NaN instead of looking valid (its FP8 codes are unspecified).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nemo_jetrl.fp8.formats import Fp8Format, get_format
from nemo_jetrl.fp8.spec import BLOCKS, Block

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SIGN_EXP_MASK = -8388608  # 0xFF800000 as int32: sign and exponent bits of an fp32


@dataclass(frozen=True, eq=False)
class BlockQuantized:
    """An FP8 tensor with one fp32 dequantization multiplier per block (compact layout).

    ``data`` has the input's shape. ``scale_inv`` is ``[ceil(M/bm), ceil(K/bk)]`` for 2-D input
    (for N-D 1x128 input: ``[*leading_dims, ceil(K/128)]``).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: Block
    fmt: str
    pow2_scales: bool

    @property
    def format(self) -> Fp8Format:
        return get_format(self.fmt)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale_inv`` broadcast over each block, computed in fp32, cast to ``dtype``."""
        bm, bk = self.block
        data2 = self.data.reshape(-1, self.data.shape[-1])
        m, k = data2.shape
        sinv = self.scale_inv.reshape(-1, self.scale_inv.shape[-1])
        full = sinv.repeat_interleave(bm, dim=0)[:m].repeat_interleave(bk, dim=1)[:, :k]
        return (data2.float() * full).to(dtype).reshape(self.data.shape)

    def t(self) -> BlockQuantized:
        """The transpose, reusing the same blocks (128x128 stays 128x128; 1x128 becomes 128x1).

        This is how DGrad uses the forward weight: no requantization, identical bits.
        """
        if self.data.dim() != 2:
            raise ValueError("BlockQuantized.t() needs 2-D data")
        bm, bk = self.block
        return BlockQuantized(
            self.data.t(), self.scale_inv.t(), (bk, bm), self.fmt, self.pow2_scales
        )


def compute_scale(
    amax: torch.Tensor,
    fmt: Fp8Format,
    *,
    pow2_scales: bool,
    eps: float = 0.0,
    input_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Quantization multipliers (fp32) from per-block amax, exactly as the spec states."""
    amax = amax.float()
    if eps > 0.0:
        amax = torch.clamp_min(amax, eps)
    scale = torch.full_like(amax, fmt.fmax) / amax
    scale = torch.where(torch.isinf(scale), torch.finfo(input_dtype).max, scale)
    if pow2_scales:
        scale = (scale.view(torch.int32) & _SIGN_EXP_MASK).view(torch.float32)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def cast_to_fp8(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of fp32 values (clamped first: old torch gave NaN)."""
    return torch.clamp(x, -fmt.fmax, fmt.fmax).to(fmt.dtype)


def check_block(block: Block) -> Block:
    """``block`` as a tuple of ints, or ValueError when it is not one of `BLOCKS`."""
    block = tuple(int(b) for b in block)  # type: ignore[assignment]
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block}")
    return block


def as_2d(x: torch.Tensor, block: Block, label: str) -> torch.Tensor:
    """``x`` as the 2-D matrix the blocks tile (N-D input only for 1x128), dtype checked."""
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{label}: dtype {x.dtype} cannot be quantized; pass bfloat16, float16 or float32"
        )
    if x.dim() == 2:
        return x
    if block == (1, 128) and x.dim() >= 1:
        return x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    raise ValueError(f"{label}: block {block} needs 2-D input, got shape {tuple(x.shape)}")


def _blocks(x2: torch.Tensor, block: Block) -> torch.Tensor:
    """View ``x2`` zero-padded to whole blocks as ``[Mb, bm, Kb, bk]``."""
    bm, bk = block
    m, k = x2.shape
    mb, kb = -(-m // bm), -(-k // bk)
    if (mb * bm, kb * bk) != (m, k):
        x2 = F.pad(x2, (0, kb * bk - k, 0, mb * bm - m))
    return x2.reshape(mb, bm, kb, bk)


def _raise_non_finite(x2: torch.Tensor, amax: torch.Tensor, block: Block, label: str) -> None:
    bm, bk = block
    bad_blocks = (~torch.isfinite(amax)).nonzero()
    i, j = (int(v) for v in bad_blocks[0])
    rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bk, (j + 1) * bk)
    sub = x2[rows, cols]
    r, c = (int(v) for v in (~torch.isfinite(sub)).nonzero()[0])
    value = float(sub[r, c])
    raise ValueError(
        f"{label}: non-finite value {value} at [{i * bm + r}, {j * bk + c}] in block ({i}, {j}) "
        f"(rows {rows.start}:{min(rows.stop, x2.shape[0])}, cols {cols.start}:"
        f"{min(cols.stop, x2.shape[1])}); {len(bad_blocks)} block(s) affected. "
        "Refusing to quantize: fix the producer of this tensor (diverged update? bad checkpoint?)."
    )


def quantize_reference(
    x: torch.Tensor,
    block: Block,
    *,
    fmt: str | Fp8Format = "e4m3",
    pow2_scales: bool = True,
    eps: float = 0.0,
    name: str | None = None,
    check_finite: bool = True,
) -> BlockQuantized:
    """Quantize ``x`` to FP8 with one scale per ``block`` (see the module docstring for the math).

    ``block`` is ``(1, 128)`` (per token along K; N-D input allowed), ``(128, 128)`` (weights) or
    ``(128, 1)`` (128 tokens of one channel, for WGrad). The result is never transposed: for
    ``(128, 1)`` it equals TE's columnwise output transposed back.

    This is the pure torch reference on any device. Callers use
    `nemo_jetrl.fp8.quantize_blockwise` (`dispatch.py`), which chooses between this function
    and the bit-identical Triton kernel. ``check_finite=False``: no host sync; non-finite blocks
    get a NaN ``scale_inv`` instead of an error.
    """
    block = check_block(block)
    f = get_format(fmt)
    label = f"quantize_blockwise(tensor {name!r})" if name else "quantize_blockwise"
    x2 = as_2d(x, block, label)
    xb = _blocks(x2, block)
    amax = xb.abs().amax(dim=(1, 3)).float()
    if check_finite and not bool(torch.isfinite(amax).all()):
        _raise_non_finite(x2, amax, block, label)
    scale = compute_scale(amax, f, pow2_scales=pow2_scales, eps=eps, input_dtype=x.dtype)
    q = cast_to_fp8(xb.float() * scale[:, None, :, None], f)
    mb, bm, kb, bk = q.shape
    q = q.reshape(mb * bm, kb * bk)[: x2.shape[0], : x2.shape[1]].reshape(x.shape)
    scale_inv = 1.0 / scale
    if not check_finite:
        scale_inv = torch.where(torch.isfinite(amax), scale_inv, torch.nan)
    if x.dim() != 2:
        scale_inv = scale_inv.reshape(*x.shape[:-1], kb)
    return BlockQuantized(q.contiguous(), scale_inv, block, f.name, pow2_scales)


def fp8_bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of an FP8 tensor as uint8 (for bitwise comparisons and serialization)."""
    return t.view(torch.uint8)
