"""The jitted fixed-split FP8 GEMM behind `nemo_jetrl.fp8.triton_split` (read its docstring).

Imports triton at its top like `_triton_gemm_jit`; only `triton_split._kernel()` imports it.
Every tile is computed swapped: the weight's rows are the MMA's M dimension (64 rows, Hopper's
wgmma height, for every batch size) and the tokens its N dimension, so a decode batch of one
token wastes no MMA rows and the instruction never changes with M.
"""

import triton
import triton.language as tl

try:  # griddepcontrol (programmatic dependent launch): Triton 3.6 and 3.9 have it
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: `triton_split.SPLIT_PDL` is refused on the host
    gdc_launch_dependents = gdc_wait = None

from nemo_jetrl.fp8._triton_common import ROWS, _operand, quantize_blocks, to_fp32

# DOT modes: the FP8 types on tensor cores; exact fp32 values from tables in TF32 (GPUs without
# an FP8 dot for these formats); the same tables in float64, one rounding per tile (the
# interpreter: the tile dot is then exact and the kernel gives `split_order_matmul`'s bits).
DOT_NATIVE = tl.constexpr(0)
DOT_TF32 = tl.constexpr(1)
DOT_EXACT = tl.constexpr(2)


@triton.jit
def _tile_dot(w, xq, lut_w_ptr, lut_x_ptr, DOT: tl.constexpr, FP8_W: tl.constexpr,
              FP8_X: tl.constexpr):  # fmt: skip
    # [BW, 128] weight codes x [BT, 128] token codes -> fp32 [BW, BT]: one K tile's dot.
    wv = _operand(w, lut_w_ptr, DOT == DOT_NATIVE, FP8_W)
    xv = tl.trans(_operand(xq, lut_x_ptr, DOT == DOT_NATIVE, FP8_X))
    if DOT == DOT_NATIVE:
        p = tl.dot(wv, xv, out_dtype=tl.float32)
    elif DOT == DOT_TF32:
        p = tl.dot(wv, xv, input_precision="tf32", out_dtype=tl.float32)
    else:
        p = tl.dot(
            wv.to(tl.float64), xv.to(tl.float64), input_precision="ieee", out_dtype=tl.float64
        ).to(tl.float32)
    return p


@triton.jit
def _chunk_sum(
    x_ptr, a_ptr, sa_ptr, b_ptr, sb_ptr, lut_a_ptr, lut_b_ptr,
    rw, rt, c, M, N, K, KB,
    sxm, sxk, sam, sak, ssam, ssak, sbn, sbk, ssbn, ssbk,
    CHUNK: tl.constexpr, B_ROWS: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr,
    FUSED: tl.constexpr, IN_BF16: tl.constexpr, FMAX: tl.constexpr, MAXV: tl.constexpr,
    EPS: tl.constexpr, POW2: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    NATIVE_CAST: tl.constexpr, DOT: tl.constexpr, FP8_A: tl.constexpr, FP8_B: tl.constexpr,
    TMA_W: tl.constexpr,
):  # fmt: skip
    # Chunk c's sum for weight rows rw and tokens rt, from zero, in TE's per-tile order:
    #   acc = fma(p_t * sa[token, t], sb[row, t], acc)   (`split_order` module docstring).
    # FUSED: the tokens arrive unquantized and each 1x128 block is quantized here with the
    # quantizer's own helpers (the codes and scale_inv `quantize_blockwise` writes).
    rk = tl.arange(0, 128).to(tl.int64)
    acc = tl.zeros([BW, BT], dtype=tl.float32)
    t_end = tl.minimum((c + 1) * CHUNK, KB)
    for t in range(c * CHUNK, t_end):
        k = t * 128 + rk
        kmask = k[None, :] < K
        if TMA_W:  # a descriptor over [N, K] in [BW, 128] blocks (out of bounds read as 0)
            w = b_ptr.load([tl.program_id(0) * BW, t * 128])
        else:
            w = tl.load(b_ptr + rw[:, None] * sbn + k[None, :] * sbk,
                        mask=(rw[:, None] < N) & kmask, other=0.0)  # fmt: skip
        tmask = (rt[:, None] < M) & kmask
        if FUSED:
            xv = tl.load(x_ptr + rt[:, None] * sxm + k[None, :] * sxk, mask=tmask, other=0)
            xq, sa = quantize_blocks(to_fp32(xv, IN_BF16), ROWS, FMAX, MAXV, EPS, POW2, MANT,
                                     BIAS, NATIVE_CAST, FP8_A)  # fmt: skip
        else:
            xq = tl.load(a_ptr + rt[:, None] * sam + k[None, :] * sak, mask=tmask, other=0.0)
            sa = tl.load(sa_ptr + rt * ssam + t * ssak, mask=rt < M, other=0.0)
        p = _tile_dot(w, xq, lut_b_ptr, lut_a_ptr, DOT, FP8_B, FP8_A)
        sb = tl.load(sb_ptr + (rw // B_ROWS) * ssbn + t * ssbk, mask=rw < N, other=0.0)
        acc = tl.fma(p * sa[None, :], sb[:, None], acc)
    return acc


@triton.jit
def split_gemm_kernel(
    x_ptr, a_ptr, sa_ptr, b_ptr, sb_ptr, lut_a_ptr, lut_b_ptr, ws_ptr, cnt_ptr, c_ptr,
    M, N, K, KB, S,
    sxm, sxk, sam, sak, ssam, ssak, sbn, sbk, ssbn, ssbk, sws, swm, scm, scn,
    CHUNK: tl.constexpr, B_ROWS: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr,
    SPLIT: tl.constexpr, FUSED: tl.constexpr, IN_BF16: tl.constexpr, FMAX: tl.constexpr,
    MAXV: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr, MANT: tl.constexpr,
    BIAS: tl.constexpr, NATIVE_CAST: tl.constexpr, DOT: tl.constexpr, FP8_A: tl.constexpr,
    FP8_B: tl.constexpr, TMA_W: tl.constexpr, PREFETCH: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    # Program (w, t[, c]): weight rows [w*BW, +BW) x tokens [t*BT, +BT).
    # TMA_W: b_ptr is a TMA descriptor over the weight (the same codes, loaded by the TMA unit).
    # PREFETCH (split mode, contiguous 1-byte codes, K % 16 == 0): the program's whole weight
    # chunk is asked of L2 first (`_prefetch_rows_l2`); nothing else changes.
    # PDL (launched as a programmatic dependent launch, sm_90+): the program may start while the
    # kernel before it on the stream finishes, so nothing before `gdc_wait` reads what an
    # earlier kernel writes or writes at all (only the weight prefetch, a hint, runs there);
    # once its sums are done it lets the next such launch start (`gdc_launch_dependents`).
    # SPLIT: chunk c = program_id(2) only, its partial stored to ws[c]; the tile's last program
    # to finish adds the S partials in chunk order (`_fold_last`). Else every chunk here, folded
    # left to right in registers.
    rw = tl.program_id(0).to(tl.int64) * BW + tl.arange(0, BW)
    rt = tl.program_id(1).to(tl.int64) * BT + tl.arange(0, BT)
    if SPLIT:  # noqa: SIM108 (a statement-level constexpr branch: only the taken one compiles)
        c0 = tl.program_id(2)
    else:
        c0 = 0
    if PREFETCH:
        k_lo = c0 * CHUNK * 128
        _prefetch_rows_l2(b_ptr, rw, N, sbn, k_lo, tl.minimum(K - k_lo, CHUNK * 128))
    if PDL:
        gdc_wait()
    total = _chunk_sum(x_ptr, a_ptr, sa_ptr, b_ptr, sb_ptr, lut_a_ptr, lut_b_ptr, rw, rt, c0,
                       M, N, K, KB, sxm, sxk, sam, sak, ssam, ssak, sbn, sbk, ssbn, ssbk, CHUNK,
                       B_ROWS, BW, BT, FUSED, IN_BF16, FMAX, MAXV, EPS, POW2, MANT, BIAS,
                       NATIVE_CAST, DOT, FP8_A, FP8_B, TMA_W)  # fmt: skip
    mask = (rt[None, :] < M) & (rw[:, None] < N)
    dst = c_ptr + rt[None, :] * scm + rw[:, None] * scn
    if SPLIT:
        if PDL:
            gdc_launch_dependents()
        part = ws_ptr + rt[None, :] * swm + rw[:, None]
        tl.store(part + c0.to(tl.int64) * sws, total, mask=mask)
        _fold_last(part, cnt_ptr, dst, mask, S, sws)
    else:
        # the same adds, in the same order, as `_fold_last` makes of the partials
        for c in range(1, S):
            total += _chunk_sum(x_ptr, a_ptr, sa_ptr, b_ptr, sb_ptr, lut_a_ptr, lut_b_ptr, rw,
                                rt, c, M, N, K, KB, sxm, sxk, sam, sak, ssam, ssak, sbn, sbk,
                                ssbn, ssbk, CHUNK, B_ROWS, BW, BT, FUSED, IN_BF16, FMAX, MAXV,
                                EPS, POW2, MANT, BIAS, NATIVE_CAST, DOT, FP8_A, FP8_B, TMA_W)  # fmt: skip
        if PDL:
            gdc_launch_dependents()
        tl.store(dst, total.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefetch_rows_l2(b_ptr, rw, N, sbn, k_lo, nbytes):
    # One bulk L2 prefetch per weight row: bytes [k_lo, k_lo + nbytes) of each row the program
    # reads (a decode program's chunk: 64 rows x 1 KB), so the whole chunk is in flight from HBM
    # at once instead of the K loop's few stages; the loop's loads then hit L2. A hint only
    # (nothing is written); rows past N ask for nothing. Sizes and addresses are multiples of 16
    # (the host's condition). Hopper's instruction: not run by the interpreter.
    size = tl.where(rw < N, nbytes, 0).to(tl.int32)
    addr = (b_ptr + tl.where(rw < N, rw, 0) * sbn + k_lo).to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _fold_last(part, cnt_ptr, dst, mask, S, sws):
    # out = ((ws[0] + ws[1]) + ws[2]) + ...: the tile's partials in chunk order, cast once, by
    # whichever of its S programs counts last. The barrier puts every thread's partial store
    # before the release; the acquire (broadcast to the program's threads through a barrier)
    # puts the other programs' stores before the loads, which read L2 (.cg: never a stale L1
    # line). The folder zeroes the counter for the next call (a later launch on the stream).
    tl.debug_barrier()
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == S - 1:
        total = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
        for _ in range(1, S):
            part += sws  # one chunk on (pointer steps: no int32 product to overflow)
            total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(dst, total.to(dst.dtype.element_ty), mask=mask)
        tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
