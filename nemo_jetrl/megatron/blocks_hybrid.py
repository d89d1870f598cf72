"""The gated delta net's in_proj for `blocks`: which rows of which HF weight each tensor-parallel
rank's TE weight holds, and whether TE's 128-row blocks of it are blocks the rollout quantizes.

Megatron-Core 0.16.1 (``ssm.gated_delta_net.GatedDeltaNet``, Qwen3.5 / Qwen3-Next linear
attention) computes q, k, v, z, b and a in ONE ``in_proj`` GEMM (``TELayerNormColumnParallelLinear``,
an FP8 linear). Rank ``r`` of ``TP`` holds ``[q_r; k_r; v_r; z_r; b_r; a_r]`` (the split in
``GatedDeltaNet.forward`` and ``sharded_state_dict``; Megatron-Bridge's GDN mappings lay the
global tensor out so that its TP chunks are that): the rank's ``nk / TP`` key heads of q and of
k (``linear_key_head_dim`` rows each), its ``nv / TP`` value heads of v and of z
(``linear_value_head_dim`` rows each), then one row per value head of b and of a. The rollout
quantizes the HF weights, each on its own, in 128-row blocks from row 0:

- Qwen3.5 (``split``): ``in_proj_qkv`` = [q of every key head; k; v of every value head],
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (one row per value head);
- Qwen3-Next: ``in_proj_qkvz`` = per key head ``[q_i; k_i; v, z of its nv / nk value heads]``,
  ``in_proj_ba`` = per key head ``[b; a of its value heads]``.

A training block is the rollout's when it holds exactly the rows of one 128-row block of one HF
weight (a weight's last, partial block included), in any order: same amax, scale and codes.
Qwen3.5's b_r and a_r (``nv / TP`` rows each, never 128) share a block that the rollout splits
into in_proj_b's and in_proj_a's, at any TP. Qwen3-Next's b and a rows at TP 1 are all of
in_proj_ba, one partial block on both sides (with key and value head dims multiples of 128, its
in_proj is the rollout's); from TP 2 a rank holds part of that block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nemo_jetrl.arch.hybrid import MEGATRON_IN_PROJ_GROUPS
from nemo_jetrl.fp8.spec import BLOCK

Segment = tuple[str, int, int]
"""(HF weight, its first row, rows) of a run of a rank's local rows."""


def hf_parts(split: bool) -> tuple[str, ...]:
    """The HF weights of in_proj: Qwen3.5's four (``split``) or Qwen3-Next's two."""
    return MEGATRON_IN_PROJ_GROUPS[0 if split else 1]


@dataclass(frozen=True)
class GdnShape:
    """The gated delta net's sizes (TransformerConfig's ``linear_*`` fields)."""

    num_k_heads: int
    k_head_dim: int
    num_v_heads: int
    v_head_dim: int

    @property
    def kd(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def vd(self) -> int:
        return self.num_v_heads * self.v_head_dim

    def hf_rows(self, split: bool) -> dict[str, int]:
        """Rows of each HF weight of in_proj."""
        nv = self.num_v_heads
        if split:
            rows = (2 * self.kd + self.vd, self.vd, nv, nv)
        else:
            rows = (2 * (self.kd + self.vd), 2 * nv)
        return dict(zip(hf_parts(split), rows, strict=True))

    def rank_rows(self, tp: int, rank: int, split: bool) -> list[Segment]:
        """The HF rows rank ``rank`` of ``tp`` holds, in the order of its local in_proj weight."""
        nk, nv = self.num_k_heads // tp, self.num_v_heads // tp
        hk, hv = self.k_head_dim, self.v_head_dim
        if split:
            qkv, z, b, a = hf_parts(split)
            kr, vr = nk * hk, nv * hv
            return [
                (qkv, rank * kr, kr),
                (qkv, self.kd + rank * kr, kr),
                (qkv, 2 * self.kd + rank * vr, vr),
                (z, rank * vr, vr),
                (b, rank * nv, nv),
                (a, rank * nv, nv),
            ]
        qkvz, ba = hf_parts(split)
        g = self.num_v_heads // self.num_k_heads  # value heads per key head
        per_key = 2 * hk + 2 * g * hv  # one key head's rows of in_proj_qkvz
        heads = range(rank * nk, (rank + 1) * nk)
        return (
            [(qkvz, i * per_key, hk) for i in heads]
            + [(qkvz, i * per_key + hk, hk) for i in heads]
            + [(qkvz, i * per_key + 2 * hk, g * hv) for i in heads]
            + [(qkvz, i * per_key + 2 * hk + g * hv, g * hv) for i in heads]
            + [(ba, i * 2 * g, g) for i in heads]
            + [(ba, i * 2 * g + g, g) for i in heads]
        )


def _held(weight: str, rows: list[int]) -> str:
    lo, hi = rows[0], rows[-1]
    if rows == list(range(lo, hi + 1)):
        return f"{weight} rows {lo}-{hi}"
    return f"{len(rows)} rows of {weight} between {lo} and {hi}"


def foreign_block(local: Sequence[Segment], sizes: Mapping[str, int]) -> str | None:
    """The first of TE's 128-row blocks of a local weight laid out as ``local`` that is no
    128-row block of one HF weight (``sizes``: each one's rows), in words; None: each is one."""
    rows = [(w, r) for w, start, n in local for r in range(start, start + n)]
    for b in range(0, len(rows), BLOCK):
        chunk = rows[b : b + BLOCK]
        held = {
            w: sorted(r for x, r in chunk if x == w) for w in dict.fromkeys(w for w, _ in chunk)
        }
        theirs = ""
        if len(held) == 1:  # one HF weight's rows: the same block unless it cuts theirs
            ((w, idx),) = held.items()
            lo = idx[0] - idx[0] % BLOCK
            block = list(range(lo, min(lo + BLOCK, sizes[w])))  # the rollout's block of them
            if idx == block:
                continue
            theirs = f" (the rollout's block: {_held(w, block)})"
        parts = " + ".join(_held(w, idx) for w, idx in held.items())
        return f"rows {b}-{b + len(chunk) - 1} holds {parts}{theirs}"
    return None


def _cut(shape: GdnShape, tp: int, split: bool) -> str | None:
    """The first rank's block that is not the rollout's, in words (None: none is)."""
    sizes = shape.hf_rows(split)
    for rank in range(tp):
        what = foreign_block(shape.rank_rows(tp, rank, split), sizes)
        if what is not None:
            return f"TE's block of {what}" if tp == 1 else f"TE's block of rank {rank}'s {what}"
    return None


def in_proj_problem(shape: GdnShape, tp: int, split: bool | None, tp_key: str) -> str | None:
    """Why TE's blocks of in_proj at ``tp`` ranks are not the rollout's (None: they are, or,
    ``split`` unknown, Qwen3.5's and Qwen3-Next's HF splits disagree: not judged). Names
    ``tp_key=tp`` only where a tensor-parallel size of 1 gives the rollout's blocks."""
    splits = (True, False) if split is None else (split,)
    cuts = {s: _cut(shape, tp, s) for s in splits}
    if any(c is None for c in cuts.values()):
        return None
    kr, vr, nr = shape.kd // tp, shape.vd // tp, shape.num_v_heads // tp
    rank = "" if tp == 1 else " a rank"
    if tp > 1 and all(_cut(shape, 1, s) is None for s in splits):
        rank += f" at {tp_key}={tp}"
    whys = "; ".join(
        (f"{'Qwen3.5' if s else 'Qwen3-Next'}'s HF split: " if split is None else "") + str(c)
        for s, c in cuts.items()
    )
    names = "/".join(n for s in splits for n in hf_parts(s))
    return (
        f"one GEMM of [q; k; v; z; b; a] = {kr} + {kr} + {vr} + {vr} + {nr} + {nr} rows{rank}: "
        f"{whys}; the rollout quantizes {names} each on its own in 128-row blocks"
    )
