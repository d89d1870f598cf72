"""Attention in Triton whose output row for a query has the same bits in a decode step over a KV
cache and in a prefill over the whole sequence: the invariant `ops.attention` on CUDA.

A query's keys are walked in ``BN``-wide chunks from key 0 up, with an online softmax in fp32
(running max, running sum, rescaled output), one ``tl.dot`` per chunk for the scores and one for
probabilities x values (probabilities rounded to the value dtype first, as eager attention
rounds them). ``BM`` (queries per program) and ``BN`` are launch constants, never chosen from the
number of queries or keys, and there is no split over keys (no flash-decoding): a decode step
(one query, keys ``0..t``) and a prefill (``T`` queries, a causal mask) run the same chunks in the
same order for query ``t``, and the chunks a prefill row walks past its own position add exactly
nothing (read `_jit_attention`). One kernel serves both modes.

Inputs are `ops.attention`'s: ``q [B, H, Tq, D]``, ``k``/``v [B, H, Tk, D]`` (grouped KV heads
already repeated), ``mask`` additive (0, a large negative or -inf), broadcastable to
``[B, H, Tq, Tk]``, or None. The output is fp32 ``[B, H, Tq, D]``; `ops.attention` casts it.
`attention_reference` (float64) is what the tests measure the kernel against; the kernel never
calls it. The backward (`Attention`) recomputes the probabilities with torch (not part of the
on-policy promise).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from nemo_jetrl.fp8._deps import require
from nemo_jetrl.fp8.triton_launch import NO_FMA, NO_FTZ, frozen_meta, interpreting, launch

ATTN_BLOCK_M = 64
ATTN_BLOCK_N = 64
ATTN_WARPS = 4
ATTN_STAGES = 2
"""Software-pipeline depth where the tiles fit; `attention_stages` picks 1 where they do not."""
ATTN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SMEM_LIMIT_BYTES = 232_448
"""Shared memory one block may take on Hopper (sm_90): 227 KiB of the SM's 228 KiB (CUDA
programming guide, compute capability 9.0; Triton printed "Hardware limit: 232448" on an H100,
benchmarks/gpu/results/h100_run1_landed/gpu_tests.log)."""


@functools.cache
def _jit() -> ModuleType:
    require("triton", feature="the batch-invariant Triton kernels")
    from nemo_jetrl.invariant.kernels import _jit_attention

    return _jit_attention


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for label, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != 4 or t.dtype not in ATTN_DTYPES:
            raise ValueError(
                f"attention {label}: expected a 4-d [B, H, T, D] tensor of {ATTN_DTYPES}, got "
                f"{t.dtype} {list(t.shape)}"
            )
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"attention: query {list(q.shape)}, key {list(k.shape)} and value {list(v.shape)} "
            "do not match (repeat grouped KV heads first)"
        )


def _head_block(head_dim: int) -> int:
    """``BD``: the head dimension padded to a power of two (at least 16, `tl.dot`'s minimum)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def attention_smem_bytes(
    head_dim: int,
    itemsize: int,
    stages: int,
    *,
    block_m: int = ATTN_BLOCK_M,
    block_n: int = ATTN_BLOCK_N,
) -> int:
    """An upper estimate of the kernel's shared memory: ``stages`` buffers of each loop load
    (key and value tiles at ``itemsize`` bytes, the fp32 mask tile), plus the query tile and the
    probabilities as the second dot's operand. At or above what Triton 3.9 allocates compiling
    for sm_90 at head_dim 64/128/256, 1-3 stages, bf16 and fp32 (fp32, head_dim 256: 144 KiB at 1
    stage, 224 KiB at 2; estimated 224 and 368). A slow test compiles the rule's choices."""
    bd = _head_block(head_dim)
    per_stage = 2 * block_n * bd * itemsize + block_m * block_n * 4
    return stages * per_stage + block_m * bd * itemsize + block_m * block_n * itemsize


def attention_stages(head_dim: int, itemsize: int) -> int:
    """The pipeline depth for ``head_dim`` and operands of ``itemsize`` bytes: `ATTN_STAGES`
    where `attention_smem_bytes` fits `SMEM_LIMIT_BYTES`, else 1 (fp32 operands at head_dim
    256). The count is part of the compiled kernel: on an H200 1 and 2 stages give other bits
    (bf16 at head_dim 64/128/256, fp32 at 128; GPU results runs 7 and 8), fp fusion on or off
    (`NO_FMA`). Why, in the sm_90 TTGIR (Triton 3.6, bf16, head_dim 64): at 2 stages the
    softmax's row sum ``tl.sum(p, axis=1)`` reduces in the wgmma accumulator's layout (8
    shuffles in the PTX), at 1 stage after a conversion to a blocked layout (388 butterfly
    shuffles): another summation order. So the count depends on the head dim and operand size
    alone, never on the batch: a decode step and a prefill, trainer and rollout, launch the
    same kernel.
    Tiles stay fixed: ``BN`` is part of a row's order and ``BM`` picks the MMA instruction."""
    fits = attention_smem_bytes(head_dim, itemsize, ATTN_STAGES) <= SMEM_LIMIT_BYTES
    return ATTN_STAGES if fits else 1


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    *,
    block_m: int = ATTN_BLOCK_M,
    block_n: int = ATTN_BLOCK_N,
    num_stages: int | None = None,
) -> torch.Tensor:
    """fp32 ``softmax(q k^T * scaling + mask) v``, ``[B, H, Tq, D]`` (no grad). ``num_stages``
    None: `attention_stages`, what every caller uses (another count is another kernel, with
    its own bits: tests and benchmarks only)."""
    _check(q, k, v)
    if not (q.dtype == k.dtype == v.dtype):  # widen all to fp32: exact
        q, k, v = q.float(), k.float(), v.float()
    q, k, v = _last_dim_unit(q), _last_dim_unit(k), _last_dim_unit(v)
    bsz, heads, tq, d = q.shape
    tk = k.shape[2]
    out = torch.empty(bsz, heads, tq, d, dtype=torch.float32, device=q.device)
    if not out.numel():
        return out
    if mask is not None:
        mask = mask.float().expand(bsz, heads, tq, tk)
        sm = mask.stride()
    else:
        mask, sm = out, (0, 0, 0, 0)  # never read (HAS_MASK=False)
    grid = (-(-tq // block_m), bsz * heads)
    stages = attention_stages(d, q.element_size()) if num_stages is None else num_stages
    args = (
        q, k, v, mask, out, heads, tq, tk, d, float(scaling),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *sm, out.stride(0), out.stride(1), out.stride(2),
    )  # fmt: skip
    meta = _meta(mask is not out, block_m, block_n, _head_block(d), q.dtype == torch.float32,
                 interpreting(), stages)  # fmt: skip
    launch(_jit().attention_kernel, grid, args, meta)
    return out


@functools.cache
def _meta(has_mask: bool, bm: int, bn: int, bd: int, ieee: bool, ordered: bool, stages: int):  # type: ignore[no-untyped-def]
    """The kernel's constexprs and options, built once per setting (`triton_launch.launch`
    calls the compiled launcher directly after the first launch). Fusion off (`NO_FMA`): every
    fp32 add/sub/mul rounded as written (the stage count still matters: `attention_stages`)."""
    return frozen_meta(HAS_MASK=has_mask, BM=bm, BN=bn, BD=bd, IEEE=ieee, ORDERED=ordered,
                       num_warps=ATTN_WARPS, num_stages=stages, **NO_FTZ, **NO_FMA)  # fmt: skip


class Attention(torch.autograd.Function):
    """`attention` forward; the backward recomputes fp32 probabilities with torch's GEMMs and
    softmax and applies eager attention's gradient (as `ops`' torch path does)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scaling):  # type: ignore[override]
        ctx.save_for_backward(q, k, v, mask)
        ctx.scaling = scaling
        return attention(q, k, v, mask, scaling)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, mask = ctx.saved_tensors
        scores = (q.float() @ k.float().transpose(-1, -2)) * ctx.scaling
        if mask is not None:
            scores = scores + mask.float()
        p, do = torch.softmax(scores, dim=-1), dout.float()
        dv = p.transpose(-1, -2) @ do
        dp = do @ v.float().transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * ctx.scaling
        dq, dk = ds @ k.float(), ds.transpose(-1, -2) @ q.float()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """float64 attention, ``[B, H, Tq, D]``."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores + mask.double()
    return torch.softmax(scores, dim=-1) @ v.double()
