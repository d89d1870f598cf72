"""The fixed split order of the ``triton_splitk`` GEMM, and its pure-torch reference.

A decode step multiplies a few tokens by a large weight: a GEMM with small M that is bound by
reading the weight. To read it at the memory's speed the GPU must split K over many CTAs and
add their partial sums (split-K). Split-K changes the order of the additions, and with it the
bits of a token's row, unless the split is a property of K alone. This module holds that rule:

* K is cut into 128-wide tiles (the FP8 scale blocks) and the tiles into *chunks* of
  `CHUNK_TILES` consecutive tiles (the last may be shorter). The number of chunks,
  `split_count(K)`, depends on K only, never on M.
* Chunk ``c`` accumulates its tiles in Transformer Engine's per-tile order, from zero:
  ``acc = fma(p_t * sa_t, sb_t, acc)`` (`gemm.blockwise_matmul(exact=True)`).
* The chunk sums are added left to right: ``((s_0 + s_1) + s_2) + ...``, then cast once.

A kernel may compute the chunks in one CTA (large M: two fp32 tiles in registers) or in
separate CTAs and fold their partials afterwards (small M): every output element sees the same
operations in the same order either way, so a token's row has the same bits at M = 1 and among
8192 tokens, and the serving kernel's rows equal the trainer's forward when both run this GEMM.

`split_order_matmul` is the reference: the exact tile dots (`blockwise_matmul(exact=True)` per
chunk) folded as above. The Triton kernel (`triton_split`) gives its bits under Triton's CPU
interpreter, where the tile dot is exact too; on a GPU the tensor cores round inside a tile's
dot, so there the claim is row invariance and equality across the kernel's modes, not equality
with this reference.
"""

from __future__ import annotations

import torch

from nemo_jetrl.fp8.gemm import TILE_K, blockwise_matmul
from nemo_jetrl.fp8.quantize import BlockQuantized

CHUNK_TILES = 8
"""128-wide K tiles per chunk (1024 of K): K = 4096 gives 4 chunks, K = 12288 gives 12. Part of
the bits' definition: changing it changes every output whose K spans more than one chunk."""


def split_count(k: int) -> int:
    """How many chunks the fixed split cuts a reduction of length ``k`` into (K alone)."""
    tiles = -(-k // TILE_K)
    return max(1, -(-tiles // CHUNK_TILES))


def chunk_bounds(k: int) -> list[tuple[int, int]]:
    """``[(k0, k1), ...]``: the K range of each chunk, in fold order."""
    step = CHUNK_TILES * TILE_K
    return [(k0, min(k0 + step, k)) for k0 in range(0, max(k, 1), step)]


def _k_slice(q: BlockQuantized, k0: int, k1: int) -> BlockQuantized:
    t0, t1 = k0 // TILE_K, -(-k1 // TILE_K)
    return BlockQuantized(q.data[:, k0:k1], q.scale_inv[:, t0:t1], q.block, q.fmt, q.pow2_scales)


def split_order_matmul(
    a: BlockQuantized, b: BlockQuantized, *, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``a @ b.T`` in the fixed split order (module docstring), exact tile dots; in ``out_dtype``.

    ``a`` 1x128 ``[M, K]``; ``b`` 128x128 or 1x128 ``[N, K]`` (`gemm`'s operand convention)."""
    if a.block != (1, TILE_K):
        raise ValueError(f"split_order_matmul: a must be 1x128 blocked, got {a.block}")
    total = None
    for k0, k1 in chunk_bounds(a.data.shape[1]):
        s = blockwise_matmul(
            _k_slice(a, k0, k1), _k_slice(b, k0, k1), out_dtype=torch.float32, exact=True
        )
        total = s if total is None else total + s
    return total.to(out_dtype)
