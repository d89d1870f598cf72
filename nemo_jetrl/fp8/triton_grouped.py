"""The grouped expert linear's GPU path: each operation one Triton launch, no host read.

Same functions and bits as `experts_reference` (tested bit for bit under Triton's interpreter),
never calling it. ``offsets`` stays on the device: every kernel finds its expert there.

* `quantize_rows`: 1x128 blocks are one token each, so this is the dense Triton quantizer on the
  whole ``[M, K]`` (`triton_kernels.quantize_blockwise_triton`).
* `quantize_experts`: one 128x128 quantization of the ``[E*N, K]`` stack (N % 128 == 0, so no
  block straddles two experts), with the transposed codes written in the same pass (DGrad).
* `quantize_tokens`: per-expert 128x1 blocks. The grid has ``M//128 + E`` block columns (a bound
  on ``sum_e ceil(count_e/128)`` from the shapes); program b finds its expert e by counting
  the experts whose blocks end at or before b in ``block_offsets`` (on the device), reads
  tokens ``offsets[e] + 128 * (b - block_offsets[e])`` onwards (never past ``offsets[e+1]``),
  and writes the codes transposed and the scale into column b. Spare programs write nothing.
* `gemm_rows` (FProp, DGrad): a grouped GEMM over (row tile, column tile) pairs, row tiles of
  BM tokens per expert, each reading its expert's 128x128-blocked operand through an expert
  stride: W ``[E, N, K]`` for FProp, the transposed copy viewed ``[E, K, N]`` for DGrad. The
  tile schedule (per-expert tile counts and their prefix sum) is made inside the kernel from
  ``offsets`` (`_triton_grouped_gemm_jit`): one launch, no torch op but the output's
  allocation. `rows_tile` picks the program shape from the shapes alone (`ROWS_TILES`).
* `quantize_input` / `gemm_rows(rows=...)` (the serving MoE layer, `experts_layer`): the
  ``[T, H]`` input quantized once 1x128 (a block is one token's 128 values, so the bits are those
  of quantizing the gathered copy), and the gate/up GEMM reads each routed row's A codes and
  scale through ``rows[m]`` (its token): no BF16 gather, no FP8 gather.
* `silu_mul_quantize`: ``silu(gate) * up`` by `silu_mul`'s rule fused with the 1x128
  quantization of the down projection's input: one launch reads gate_up once and writes the
  codes and scales (launched with ``enable_fp_fusion=False`` so no mul+add becomes an fma).
* `combine`: programs of (token tile, column tile) read each token's routed rows through
  ``pos [T, k]`` and sum ``y * w`` in slot order in fp32, one rounding to the output: the
  weighted combine without atomics, without a permuted copy and without a ``[T, k, H]`` buffer.
* `gemm_tokens` (WGrad): programs (expert, N tile, K tile) loop over the expert's 128-token
  tiles; a tile's scales are in column ``block_offsets[e] + t``.

The GEMMs take each 128-wide tile's fp32 dot ``p`` of the codes (FP8 tensor cores where
`triton_gemm.native_dot` allows, else exact 256-entry value tables) and accumulate
``acc = fma(p * sa, sb, acc)``: TE's order, `gemm.blockwise_matmul(exact=True)`'s. They equal the
reference bit for bit whenever ``p`` is exact in fp32 (any order sums it the same); otherwise
only the order inside a tile's dot differs. ``exact`` is accepted and ignored (as by the dense GPU
GEMMs). `gemm_tokens`' tile is fixed; `gemm_rows` picks its program shape from M and E only
(`grouped_tiles`), and every shape runs a row's arithmetic the same way (64 or 128 rows: one
wgmma m64n128k32 per 64 rows on Hopper, never a 16-row mma; K tiles in order), so a token's bits
do not change with the batch it arrives in, nor between rollout and training.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from nemo_jetrl.fp8._deps import require
from nemo_jetrl.fp8.formats import Fp8Format, get_format
from nemo_jetrl.fp8.grouped_tensors import (
    TOKEN_ALIGN,
    GroupedQuantizedWeights,
    GroupedTokenBlocks,
    raise_non_finite_expert,
    token_block_capacity,
    token_block_offsets,
    token_capacity,
    token_offsets,
)
from nemo_jetrl.fp8.grouped_tiles import ROWS_TILES, rows_grid, rows_tile
from nemo_jetrl.fp8.quantize import BlockQuantized, quantize_reference
from nemo_jetrl.fp8.silu_mul import MODEL_DTYPES, silu_mul
from nemo_jetrl.fp8.spec import ACTIVATION_BLOCK, BLOCK, WEIGHT_BLOCK, WGRAD_BLOCK
from nemo_jetrl.fp8.triton_gemm import native_dot, pipeline_stages, value_table
from nemo_jetrl.fp8.triton_kernels import (
    NO_FTZ,
    _bits_if_bf16,
    _format_constants,
    _fp32,
    interpreting,
    quantize_blockwise_triton,
    quantize_with_transpose_triton,
)
from nemo_jetrl.fp8.triton_launch import NO_FMA, LaunchMeta, frozen_meta, launch


@functools.cache
def _kernels() -> ModuleType:
    require("triton", feature="the grouped FP8 expert kernels")
    from nemo_jetrl.fp8 import _triton_grouped_jit

    return _triton_grouped_jit


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _label(name: str, what: str) -> str:
    return f"{name}.expert{{}}.{what}"


def quantize_rows(
    x: torch.Tensor,
    offsets: torch.Tensor,
    *,
    fmt: Fp8Format,
    pow2_scales: bool,
    eps: float,
    name: str,
    what: str,
    check_finite: bool = True,
) -> BlockQuantized:
    """``x [M, K]`` quantized 1x128 (one launch; per token, so per expert too)."""
    kw = {"fmt": fmt, "pow2_scales": pow2_scales, "eps": eps}
    q = quantize_blockwise_triton(x, ACTIVATION_BLOCK, check_finite=False, **kw)
    if check_finite and not bool(torch.isfinite(q.scale_inv).all()):
        raise_non_finite_expert(x, offsets.tolist(), ACTIVATION_BLOCK, _label(name, what), **kw)
    return q


def quantize_input(
    x: torch.Tensor, *, fmt: Fp8Format, pow2_scales: bool, eps: float, name: str,
    check_finite: bool = True,
) -> BlockQuantized:  # fmt: skip
    """The unsorted ``[T, H]`` input quantized 1x128 once (one launch); a non-finite input
    raises naming ``{name}.input`` (``check_finite``, a host read)."""
    kw = {"fmt": fmt, "pow2_scales": pow2_scales, "eps": eps}
    q = quantize_blockwise_triton(x, ACTIVATION_BLOCK, check_finite=False, **kw)
    if check_finite and not bool(torch.isfinite(q.scale_inv).all()):
        quantize_reference(x.cpu(), ACTIVATION_BLOCK, name=f"{name}.input", **kw)
    return q


# Launch settings built once per configuration (`triton_launch.launch` then calls the compiled
# kernel's launcher directly after the first launch of each specialisation, on a GPU).
@functools.cache
def _silu_meta(tm: int, dtype: torch.dtype, eps: float, pow2: bool, fmt: str) -> LaunchMeta:
    return frozen_meta(
        TM=tm, MODEL=MODEL_DTYPES.index(dtype), EPS=_fp32(eps) if eps > 0 else 0.0, POW2=pow2,
        num_warps=4, **NO_FTZ, **NO_FMA, **_format_constants(get_format(fmt), dtype, False),
    )  # fmt: skip


@functools.cache
def _rows_meta(tile: str, native: bool, tf32: bool, fmts: tuple, gather: bool, e_pow2: int,
               tma: tuple[bool, bool]) -> LaunchMeta:  # fmt: skip
    t, fp8 = ROWS_TILES[tile], {"e4m3": _kernels().tl.float8e4nv, "e5m2": _kernels().tl.float8e5}
    return frozen_meta(
        BM=t.bm, BN=128, E_POW2=e_pow2, GATHER=gather, NATIVE=native, TF32=tf32,
        FP8_A=fp8[fmts[0]], FP8_B=fp8[fmts[1]], TMA_A=tma[0], TMA_B=tma[1],
        num_stages=t.stages if native else 1, **t.options,
    )  # fmt: skip


@functools.cache
def _combine_meta(k: int, tt: int, bh: int, out_bf16: bool, in_bf16: bool) -> LaunchMeta:
    return frozen_meta(K=k, TT=tt, BH=bh, OUT_BF16=out_bf16, IN_BF16=in_bf16, num_warps=4, **NO_FMA)


def silu_mul_quantize(
    gate_up: torch.Tensor, offsets: torch.Tensor, *, fmt: Fp8Format, pow2_scales: bool,
    eps: float, name: str, what: str = "input", check_finite: bool = True,
) -> BlockQuantized:  # fmt: skip
    """``gate_up [M, 2I]`` (bf16/fp16/fp32, gate first) -> `silu_mul` -> 1x128 codes ``[M, I]`` and
    ``scale_inv [M, I/128]``, in one launch; a non-finite row raises naming its expert."""
    m, two_i = gate_up.shape
    inter = two_i // 2
    if gate_up.dtype not in MODEL_DTYPES or two_i % 256:
        raise ValueError(
            f"{name}: gate_up must be bf16/fp16/fp32 [M, 2I] with I % 128 == 0, got "
            f"{gate_up.dtype} {tuple(gate_up.shape)}"
        )
    g = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    data = torch.empty(m, inter, dtype=fmt.dtype, device=g.device)
    scale = torch.empty(m, inter // BLOCK, dtype=torch.float32, device=g.device)
    tm = 32 if interpreting() else 16
    if m:
        args = (_bits_if_bf16(g), data.view(torch.uint8), scale, m, inter, g.stride(0),
                data.stride(0), scale.stride(0))  # fmt: skip
        meta = _silu_meta(tm, g.dtype, float(eps), bool(pow2_scales), fmt.name)
        launch(_kernels().silu_mul_quantize_kernel, (-(-m // tm), inter // BLOCK), args, meta)
        if check_finite and not bool(torch.isfinite(scale).all()):
            act = silu_mul(*gate_up.chunk(2, dim=-1))
            kw = {"fmt": fmt, "pow2_scales": pow2_scales, "eps": eps}
            raise_non_finite_expert(
                act, offsets.tolist(), ACTIVATION_BLOCK, _label(name, what), **kw
            )
    return BlockQuantized(data, scale, ACTIVATION_BLOCK, fmt.name, bool(pow2_scales))


def quantize_experts(
    weight: torch.Tensor,
    *,
    fmt: Fp8Format,
    pow2_scales: bool,
    eps: float,
    name: str,
    check_finite: bool = True,
    pair: bool = False,
) -> tuple[GroupedQuantizedWeights, GroupedQuantizedWeights]:
    """(W, W.t()) of ``weight [E, N, K]`` 128x128 in one launch; ``pair``: W.t() contiguous."""
    n_exp, n, k = weight.shape
    flat = weight.reshape(n_exp * n, k)
    kw = {"fmt": fmt, "pow2_scales": pow2_scales, "eps": eps}
    if pair:
        q, qt = quantize_with_transpose_triton(flat, WEIGHT_BLOCK, check_finite=False, **kw)
    else:
        q = quantize_blockwise_triton(flat, WEIGHT_BLOCK, check_finite=False, **kw)
    if check_finite and not bool(torch.isfinite(q.scale_inv).all()):
        raise_non_finite_expert(weight, None, WEIGHT_BLOCK, _label(name, "weight"), **kw)
    scale = q.scale_inv.reshape(n_exp, n // BLOCK, k // BLOCK)
    qw = GroupedQuantizedWeights(q.data.reshape(n_exp, n, k), scale, fmt.name, pow2_scales)
    if not pair:
        return qw, qw.t()
    data_t = qt.data.reshape(k, n_exp, n).permute(1, 0, 2)  # [E, K, N] view of [K, E*N]
    return qw, GroupedQuantizedWeights(data_t, scale.transpose(1, 2), fmt.name, pow2_scales)


def quantize_tokens(
    x: torch.Tensor,
    offsets: torch.Tensor,
    *,
    fmt: Fp8Format,
    pow2_scales: bool,
    eps: float,
    name: str,
    what: str,
    check_finite: bool = True,
) -> GroupedTokenBlocks:
    """``x [M, C]`` quantized 128x1 per expert (one launch), codes written ``[C, M]``."""
    m, c = x.shape
    n_exp = offsets.shape[0] - 1
    cap = token_block_capacity(m, n_exp)
    boff, toff = token_block_offsets(offsets), token_offsets(offsets)
    data = torch.empty(c, token_capacity(m, n_exp), dtype=fmt.dtype, device=x.device)
    scale = torch.zeros(c, cap, dtype=torch.float32, device=x.device)
    tc = 128 if interpreting() else 32
    if m and c:
        _kernels().quantize_tokens_kernel[(cap, -(-c // tc))](
            _bits_if_bf16(x), data.view(torch.uint8), scale, offsets, boff, toff,
            n_exp, c, x.stride(0), x.stride(1), data.stride(0), scale.stride(0),
            TC=tc, E_POW2=_pow2(n_exp), EPS=_fp32(eps) if eps > 0 else 0.0,
            POW2=bool(pow2_scales), ALIGN=TOKEN_ALIGN, num_warps=4, **NO_FTZ,
            **_format_constants(fmt, x.dtype, False),
        )  # fmt: skip
        if check_finite and not bool(torch.isfinite(scale).all()):
            kw = {"fmt": fmt, "pow2_scales": pow2_scales, "eps": eps}
            raise_non_finite_expert(x, offsets.tolist(), WGRAD_BLOCK, _label(name, what), **kw)
    return GroupedTokenBlocks(data, scale, boff, toff, fmt.name, pow2_scales)


def _dot_args(fmt_a: str, fmt_b: str, a: torch.Tensor, sa, sb) -> tuple:
    """(lut_a, lut_b, NATIVE, TF32, FP8_A, FP8_B) as `triton_gemm` chooses them."""
    jit = _kernels()
    cuda = a.is_cuda and not interpreting()
    native = cuda and native_dot((fmt_a, fmt_b), torch.cuda.get_device_capability(a.device))
    fp8 = {"e4m3": jit.tl.float8e4nv, "e5m2": jit.tl.float8e5}
    lut_a = sa if native else value_table(fmt_a, a.device)
    lut_b = sb if native else value_table(fmt_b, a.device)
    return lut_a, lut_b, native, a.is_cuda, fp8[fmt_a], fp8[fmt_b]


def _tiles(native: bool) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) of `gemm_tokens`: whole-matrix tiles under the
    interpreter."""
    return (128, 128, 4, 1) if interpreting() else (64, 128, 4, pipeline_stages(native))


def _tma(t: torch.Tensor, shape: list[int], rows: int):
    """A TMA descriptor over contiguous ``t`` seen as 2-D ``shape`` (``[M, K]`` codes, or the
    ``[E*N, K]`` weight stack), loading ``[rows, 128]`` blocks: host metadata, no torch op."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, shape, [shape[1], 1], [rows, 128])


def _tma_ok(t: torch.Tensor) -> bool:
    # TMA reads whole contiguous matrices from a 16-byte aligned base (a vLLM parameter may be
    # a view); anything else keeps the pointer loads.
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _store_dtype(out_dtype: torch.dtype) -> torch.dtype:
    # The interpreter's own fp32 -> bf16 conversion truncates: write fp32 there, round in torch.
    return torch.float32 if interpreting() else out_dtype


def gemm_rows(
    qa: BlockQuantized,
    qb: GroupedQuantizedWeights,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    exact: bool,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[rows_e] = a[rows_e] @ b[e].T`` for all experts in one launch (``exact``: TE's
    per-tile order always; accepted for the reference's signature). ``rows`` (int64 ``[M]``):
    output row m reads A row ``rows[m]`` (codes and scale), no gathered copy."""
    del exact
    m, k = (qa.data.shape[0] if rows is None else rows.shape[0]), qa.data.shape[1]
    n_exp, n = qb.num_experts, qb.out_features
    out = torch.empty(m, n, dtype=_store_dtype(out_dtype), device=qa.data.device)
    if m and n and not k:
        out.zero_()  # an empty sum (the kernel reads one K tile's scales up front)
    elif m and n:
        sa, sb = qa.scale_inv, qb.scale_inv
        lut_a, lut_b, native, tf32, _, _ = _dot_args(qa.fmt, qb.fmt, qa.data, sa, sb)
        # FP8 pointers on the tensor-core path: the loads land in shared memory as the MMA's
        # operands (a uint8 load would pass through registers to be bitcast and stored again).
        qa8, qb8 = (qa.data, qb.data) if native else (_u8(qa.data), _u8(qb.data))
        name = rows_tile(m, n_exp)
        tile = ROWS_TILES[name]
        grid = rows_grid(tile, m, n, n_exp, qa.data.device, interpreting())
        tma_a = tile.tma and rows is None and _tma_ok(qa8)
        tma_b = tile.tma and _tma_ok(qb8)
        args = (
            _tma(qa8, [qa8.shape[0], k], tile.bm) if tma_a else qa8,
            _tma(qb8, [n_exp * n, k], 128) if tma_b else qb8, out,
            sa, sb, lut_a, lut_b, offsets, rows if rows is not None else offsets,
            n_exp, n, k, qa8.stride(0), qa8.stride(1), qb8.stride(0), qb8.stride(1),
            qb8.stride(2), out.stride(0), out.stride(1), sa.stride(0), sa.stride(1),
            sb.stride(0), sb.stride(1), sb.stride(2),
        )  # fmt: skip
        meta = _rows_meta(name, native, tf32, (qa.fmt, qb.fmt), rows is not None, _pow2(n_exp),
                          (tma_a, tma_b))  # fmt: skip
        kernel = _kernels().grouped_rows_gemm_kernel
        if tma_a or tma_b:  # descriptors: through Triton's own launch path
            kernel[(grid,)](*args, **meta)
        else:
            launch(kernel, (grid,), args, meta)
    return out.to(out_dtype)


def gemm_tokens(
    qa: GroupedTokenBlocks,
    qb: GroupedTokenBlocks,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    exact: bool,
) -> torch.Tensor:
    """``out[e] = a_e @ b_e.T`` over expert e's tokens for all experts in one launch:
    ``[E, N, K]`` (WGrad: a = dY.T ``[N, M]``, b = X.T ``[K, M]``). Both operands' codes are
    read where their ``token_offsets`` put them (16-aligned: 16-byte loads)."""
    del exact
    n, k = qa.data.shape[0], qb.data.shape[0]
    n_exp = offsets.shape[0] - 1
    out = torch.empty(n_exp, n, k, dtype=_store_dtype(out_dtype), device=qa.data.device)
    if n and k:
        qa8, qb8 = qa.data.view(torch.uint8), qb.data.view(torch.uint8)
        sa, sb = qa.scale_inv, qb.scale_inv
        lut_a, lut_b, native, tf32, fa, fb = _dot_args(qa.fmt, qb.fmt, qa.data, sa, sb)
        bm, bn, warps, stages = _tiles(native)
        _kernels().grouped_tokens_gemm_kernel[(n_exp, -(-n // bm), -(-k // bn))](
            qa8, qb8, out, sa, sb, lut_a, lut_b, qa.token_offsets, qa.block_offsets, n, k,
            qa8.stride(0), qa8.stride(1), qb8.stride(0), qb8.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
            BM=bm, BN=bn, NATIVE=native, TF32=tf32, FP8_A=fa, FP8_B=fb, ALIGN=TOKEN_ALIGN,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out.to(out_dtype)


def combine(
    y: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``out[t] = sum_j y[pos[t, j]] * weight[pos[t, j]]`` (``pos`` int64 ``[T, k]``, -1 absent)
    in slot order, fp32, rounded once to ``out_dtype``: one launch."""
    t, k = pos.shape
    h = y.shape[1]
    yc = y if y.stride(1) == 1 else y.contiguous()
    out = torch.empty(t, h, dtype=out_dtype, device=y.device)
    if t and h:
        bf16 = out_dtype == torch.bfloat16
        tt, bh = (16, 128) if interpreting() else (4, 256)
        args = (_bits_if_bf16(yc), weight.float().contiguous(), pos.contiguous(),
                out.view(torch.int16) if bf16 else out, t, h, yc.stride(0), k, h)  # fmt: skip
        meta = _combine_meta(k, tt, bh, bf16, yc.dtype == torch.bfloat16)
        launch(_kernels().combine_kernel, (-(-t // tt), -(-h // bh)), args, meta)
    return out
