"""The FP8 operands of the grouped expert linear (`experts`) and the index maths they share.

Tokens arrive sorted by expert: rows ``offsets[e]:offsets[e+1]`` of ``x [M, K]`` belong to
expert ``e`` (``offsets`` is int64 ``[E+1]``, ``offsets[0] = 0``, ``offsets[E] = M``; an expert
may get no token). Two containers hold what the grouped GEMMs read:

* `GroupedQuantizedWeights`: the E expert weights ``[E, N, K]`` quantized 128x128, ``scale_inv``
  ``[E, N/128, K/128]``. Block (i, j) of expert e covers ``weight[e, 128i:128i+128,
  128j:128j+128]``; since N is a multiple of 128 this is also block ``(e*N/128 + i, j)`` of the
  flattened ``[E*N, K]`` matrix, so one 128x128 quantization of the flattened stack gives every
  expert's own bits (no block straddles two experts).
* `GroupedTokenBlocks`: a ``[M, C]`` tensor quantized 128x1 *per expert* (WGrad's operands): the
  blocks of expert e start at its first token, ``offsets[e]``, and its last block may be short.
  Stored transposed like TE's columnwise data: ``data [C, token_capacity]`` with expert e's
  tokens in columns ``token_offsets[e]:`` (``[0, cumsum(ceil16(count_e))]``: every expert starts
  16-aligned, so the WGrad GEMM loads 16 codes at a time; the up to 15 columns after its last
  token hold +0 codes), and ``scale_inv [C, capacity]`` with expert e's blocks in columns
  ``block_offsets[e]:block_offsets[e+1]`` (``[0, cumsum(ceil(count_e / 128))]``). Both offsets
  are computed on the device (no host read); ``capacity = M // 128 + E`` and ``token_capacity =
  ceil16(M + 15 E)`` bound them from the shapes alone. Scale columns past ``block_offsets[E]``
  hold zeros; code columns past ``token_offsets[E]`` are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_jetrl.fp8.formats import Fp8Format, get_format
from nemo_jetrl.fp8.quantize import BlockQuantized, quantize_reference
from nemo_jetrl.fp8.spec import BLOCK, WEIGHT_BLOCK


@dataclass(frozen=True, eq=False)
class GroupedQuantizedWeights:
    """E expert weights quantized 128x128: ``data`` float8 ``[E, N, K]`` (possibly a strided
    view, see `t`), ``scale_inv`` fp32 ``[E, ceil(N/128), ceil(K/128)]``."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    fmt: str
    pow2_scales: bool

    @property
    def format(self) -> Fp8Format:
        return get_format(self.fmt)

    @property
    def num_experts(self) -> int:
        return int(self.data.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.data.shape[1])

    @property
    def in_features(self) -> int:
        return int(self.data.shape[2])

    def expert(self, e: int) -> BlockQuantized:
        """Expert ``e``'s weight as the dense layer's `BlockQuantized` (views, same bits)."""
        return BlockQuantized(
            self.data[e], self.scale_inv[e], WEIGHT_BLOCK, self.fmt, self.pow2_scales
        )

    def t(self) -> GroupedQuantizedWeights:
        """Every expert transposed (``[E, K, N]``), reusing its 128x128 blocks (DGrad's operand)."""
        return GroupedQuantizedWeights(
            self.data.transpose(1, 2), self.scale_inv.transpose(1, 2), self.fmt, self.pow2_scales
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[E, N, K]`` values ``data * scale_inv`` (fp32 product, cast to ``dtype``)."""
        s = self.scale_inv.float().repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)
        s = s[:, : self.out_features, : self.in_features]
        return (self.data.float() * s).to(dtype)


@dataclass(frozen=True, eq=False)
class GroupedTokenBlocks:
    """``[M, C]`` quantized 128x1 per expert, stored transposed (see the module docstring)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block_offsets: torch.Tensor
    token_offsets: torch.Tensor
    fmt: str
    pow2_scales: bool

    def expert(self, e: int, offsets: list[int]) -> BlockQuantized:
        """Expert ``e``'s ``[C, count_e]`` operand, blocked 1x128 along its tokens (host
        offsets: for the reference and tests)."""
        counts = [offsets[i + 1] - offsets[i] for i in range(e + 1)]
        p0 = sum(-(-c // TOKEN_ALIGN) * TOKEN_ALIGN for c in counts[:e])
        b0 = sum(-(-c // BLOCK) for c in counts[:e])
        return BlockQuantized(
            self.data[:, p0 : p0 + counts[e]],
            self.scale_inv[:, b0 : b0 - (-counts[e] // BLOCK)],
            (1, BLOCK),
            self.fmt,
            self.pow2_scales,
        )


def token_block_capacity(m: int, num_experts: int) -> int:
    """Columns of a `GroupedTokenBlocks` scale: ``sum_e ceil(count_e/128) <= M//128 + E``."""
    return m // BLOCK + num_experts


TOKEN_ALIGN = 16
"""Where each expert's tokens start in a `GroupedTokenBlocks`' codes: a multiple of 16 columns
(16 FP8 codes, one 16-byte load)."""


def token_capacity(m: int, num_experts: int) -> int:
    """Code columns of a `GroupedTokenBlocks`: ``sum_e ceil16(count_e) <= M + 15 E``, rounded up
    to 16 (so each row of codes starts 16-byte aligned)."""
    return -(-(m + (TOKEN_ALIGN - 1) * num_experts) // TOKEN_ALIGN) * TOKEN_ALIGN


def token_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """``[0, cumsum(ceil16(count_e))]``: where each expert's tokens start in the codes (device)."""
    padded = (offsets[1:] - offsets[:-1] + (TOKEN_ALIGN - 1)) // TOKEN_ALIGN * TOKEN_ALIGN
    return torch.cat([offsets.new_zeros(1), torch.cumsum(padded, 0)])


def token_block_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """``[0, cumsum(ceil(count_e / 128))]``: where each expert's 128-token blocks start (device)."""
    blocks = (offsets[1:] - offsets[:-1] + (BLOCK - 1)) // BLOCK
    return torch.cat([offsets.new_zeros(1), torch.cumsum(blocks, 0)])


def expert_of_rows(offsets: torch.Tensor, m: int) -> torch.Tensor:
    """The expert of each of the ``m`` rows (int64 ``[m]``, on the device, no host read)."""
    rows = torch.arange(m, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets[1:].contiguous(), rows, right=True)


def per_expert_any(bad: torch.Tensor, owner: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` bool: whether any of the flags ``bad[i]`` owned by expert ``owner[i]`` is set."""
    hits = torch.zeros(num_experts, dtype=torch.int32, device=bad.device)
    return hits.index_add_(0, owner.clamp(max=num_experts - 1), bad.to(torch.int32)) > 0


def raise_non_finite_expert(
    t: torch.Tensor, offsets: list[int] | None, block: tuple[int, int], label: str, **kw
) -> None:
    """Raise the quantizer's error for the first expert whose part of ``t`` is not finite,
    named ``{label.format(e)}``: rows ``offsets[e]:offsets[e+1]`` of ``t``, or ``t[e]`` when
    ``offsets`` is None (the ``[E, N, K]`` weights)."""
    parts = range(len(offsets) - 1) if offsets is not None else range(t.shape[0])
    for e in parts:
        part = t[offsets[e] : offsets[e + 1]] if offsets is not None else t[e]
        if not bool(torch.isfinite(part).all()):
            quantize_reference(part.cpu(), block, name=label.format(e), **kw)
    raise RuntimeError(  # pragma: no cover - the caller saw a non-finite scale
        f"{label}: a non-finite block was flagged but no expert's values are non-finite"
    )
