"""The jitted Triton kernels behind `nemo_jetrl.fp8.triton_kernels` (read that module's docstring).

This module imports triton at its top because Triton resolves the helpers a kernel calls through
module globals (the shared helpers are `_triton_common`'s, imported here). Only
`triton_kernels._kernels()` imports it, after checking triton is installed, so `nemo_jetrl.fp8`
itself never needs triton. Every kernel takes ``flag_ptr`` and ``FLAG``: with ``FLAG`` it stores 1
into the int32 ``flag_ptr[0]`` when a block it quantized was non-finite (`finite_flags`).
"""

import triton
import triton.language as tl

from nemo_jetrl.fp8._triton_common import (
    COLS,
    ROWS,
    bf16_rne_bits,
    block_scale,
    finish_scale_inv,
    flag_non_finite,
    quantize_blocks,
    quantize_values,
    to_fp32,
)


@triton.jit
def quantize_kernel(
    x_ptr,
    q_ptr,
    qt_ptr,
    s_ptr,
    flag_ptr,
    M,
    M_OUT,
    K,
    sxm,
    sxk,
    sqm,
    sqk,
    ssm,
    ssk,
    MODE: tl.constexpr,
    WRITE_T: tl.constexpr,
    FLAG: tl.constexpr,
    TM: tl.constexpr,
    TK: tl.constexpr,
    FMAX: tl.constexpr,
    MAXV: tl.constexpr,
    EPS: tl.constexpr,
    POW2: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    NATIVE: tl.constexpr,
    FP8: tl.constexpr,
    IN_BF16: tl.constexpr,
    CHUNK: tl.constexpr,
    STAGES: tl.constexpr,
    PACK: tl.constexpr = False,
):
    # One program quantizes a TM x TK tile made of whole blocks:
    # MODE 0: TM rows x 128 (one 1x128 block per row); 1: one 128x128 block;
    # 2: 128 x TK (one 128x1 block per column; `_quantize_cols`, CHUNK, STAGES and PACK its
    # own). Rows M..M_OUT-1 (M_OUT >= M: a GEMM's row padding, mode 0 only) are stored as the
    # quantized zero rows they load as: codes 0, scale 1.
    if MODE == 2 and PACK:
        _quantize_cols_packed(x_ptr, q_ptr, s_ptr, flag_ptr, M, K, sxm, sxk, sqk, ssm, ssk, FLAG,
                              TM, TK, FMAX, MAXV, EPS, POW2, MANT, BIAS, NATIVE, FP8,
                              IN_BF16)  # fmt: skip
    elif MODE == 2:
        _quantize_cols(x_ptr, q_ptr, qt_ptr, s_ptr, flag_ptr, M, K, sxm, sxk, sqm, sqk, ssm, ssk,
                       WRITE_T, FLAG, TM, TK, CHUNK, STAGES, FMAX, MAXV, EPS, POW2, MANT, BIAS,
                       NATIVE, FP8, IN_BF16)  # fmt: skip
    else:
        _quantize_rows(x_ptr, q_ptr, qt_ptr, s_ptr, flag_ptr, M, M_OUT, K, sxm, sxk, sqm, sqk,
                       ssm, ssk, MODE, WRITE_T, FLAG, TM, TK, FMAX, MAXV, EPS, POW2, MANT, BIAS,
                       NATIVE, FP8, IN_BF16)  # fmt: skip


@triton.jit
def _quantize_rows(x_ptr, q_ptr, qt_ptr, s_ptr, flag_ptr, M, M_OUT, K, sxm, sxk, sqm, sqk, ssm,
                   ssk, MODE: tl.constexpr, WRITE_T: tl.constexpr, FLAG: tl.constexpr,
                   TM: tl.constexpr, TK: tl.constexpr, FMAX: tl.constexpr, MAXV: tl.constexpr,
                   EPS: tl.constexpr, POW2: tl.constexpr, MANT: tl.constexpr,
                   BIAS: tl.constexpr, NATIVE: tl.constexpr, FP8: tl.constexpr,
                   IN_BF16: tl.constexpr):  # fmt: skip
    # MODE 0 and 1: one read of the tile, one quantization, one store (grid (M tiles, K tiles)).
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m.to(tl.int64) * TM + tl.arange(0, TM)
    cols = pid_k.to(tl.int64) * TK + tl.arange(0, TK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask, other=0.0)
    x = to_fp32(x, IN_BF16)
    if MODE == 0:
        q, sinv = quantize_blocks(x, ROWS, FMAX, MAXV, EPS, POW2, MANT, BIAS, NATIVE, FP8)
        tl.store(s_ptr + rows * ssm + pid_k * ssk, sinv, mask=rows < M_OUT)
        flag_non_finite(flag_ptr, sinv, FLAG)
    else:
        abits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        amax_bits = tl.max(tl.max(abits, axis=1), axis=0)
        scale = block_scale(amax_bits, FMAX, MAXV, EPS, POW2)
        q = quantize_values(x, scale, FMAX, MANT, BIAS, NATIVE, FP8)
        sinv = finish_scale_inv(scale, amax_bits)
        tl.store(s_ptr + pid_m * ssm + pid_k * ssk, sinv)
        if FLAG:  # one scalar block: the marker is its scale_inv being NaN
            bad = (sinv != sinv).to(tl.int32)
            tl.store(flag_ptr, bad, mask=bad != 0)
    omask = (rows[:, None] < M_OUT) & (cols[None, :] < K)
    tl.store(q_ptr + rows[:, None] * sqm + cols[None, :] * sqk, q, mask=omask)
    if WRITE_T:  # the same codes again as a contiguous [K, M] (DGrad's weight operand)
        tl.store(qt_ptr + cols[None, :] * M + rows[:, None], q, mask=mask)


@triton.jit
def _quantize_cols(x_ptr, q_ptr, qt_ptr, s_ptr, flag_ptr, M, K, sxm, sxk, sqm, sqk, ssm, ssk,
                   WRITE_T: tl.constexpr, FLAG: tl.constexpr, TM: tl.constexpr,
                   TK: tl.constexpr, CHUNK: tl.constexpr, STAGES: tl.constexpr,
                   FMAX: tl.constexpr, MAXV: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                   MANT: tl.constexpr, BIAS: tl.constexpr, NATIVE: tl.constexpr,
                   FP8: tl.constexpr, IN_BF16: tl.constexpr):  # fmt: skip
    # MODE 2: TM (128) rows x TK columns, one 128x1 block per column. The grid is (K tiles,
    # M tiles): neighbouring programs read neighbouring columns of the same rows (a 128 x TK tile
    # alone is TM segments of 2 * TK bytes, each in another row). CHUNK == TM: one read, held in
    # registers; CHUNK < TM: the column amax accumulates over CHUNK-row chunks (a max of maxes:
    # the same amax), then the chunks are read again (from L2) to quantize, STAGES-deep
    # pipelined: fewer registers and overlapped loads, the same bits.
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    cols = pid_k.to(tl.int64) * TK + tl.arange(0, TK)
    cmask = cols < K
    if CHUNK == TM:
        rows = pid_m.to(tl.int64) * TM + tl.arange(0, TM)
        q, sinv, mask = _quantize_col_tile(x_ptr, rows, cols, cmask, M, sxm, sxk, FMAX, MAXV,
                                           EPS, POW2, MANT, BIAS, NATIVE, FP8, IN_BF16)  # fmt: skip
        _store_cols(q_ptr, qt_ptr, q, rows, cols, mask, M, sqm, sqk, WRITE_T)
    else:
        amax = tl.zeros([TK], dtype=tl.int32)
        for r in tl.range(0, TM, CHUNK, num_stages=STAGES):
            rows = pid_m.to(tl.int64) * TM + r + tl.arange(0, CHUNK)
            mask = (rows < M)[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask, other=0.0)
            abits = to_fp32(x, IN_BF16).to(tl.int32, bitcast=True) & 0x7FFFFFFF
            amax = tl.maximum(amax, tl.max(abits, axis=0))
        scale = block_scale(amax, FMAX, MAXV, EPS, POW2)
        sinv = finish_scale_inv(scale, amax)
        for r in tl.range(0, TM, CHUNK, num_stages=STAGES):
            rows = pid_m.to(tl.int64) * TM + r + tl.arange(0, CHUNK)
            mask = (rows < M)[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask, other=0.0)
            q = quantize_values(to_fp32(x, IN_BF16), scale[None, :], FMAX, MANT, BIAS, NATIVE, FP8)
            _store_cols(q_ptr, qt_ptr, q, rows, cols, mask, M, sqm, sqk, WRITE_T)
    tl.store(s_ptr + pid_m * ssm + cols * ssk, sinv, mask=cmask)
    flag_non_finite(flag_ptr, sinv, FLAG)


@triton.jit
def _quantize_cols_packed(x_ptr, q_ptr, s_ptr, flag_ptr, M, K, sxm, sxk, sqk, ssm, ssk,
                          FLAG: tl.constexpr, TM: tl.constexpr, TK: tl.constexpr,
                          FMAX: tl.constexpr, MAXV: tl.constexpr, EPS: tl.constexpr,
                          POW2: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
                          NATIVE: tl.constexpr, FP8: tl.constexpr, IN_BF16: tl.constexpr):  # fmt: skip
    # MODE 2 with PACK, the transposed [K, M] output only (M % 4 == 0; q_ptr its int32 words,
    # sqk words a row): the columns quantized as in `_quantize_cols`, then each thread packs
    # four tokens' codes of a column into one word before the transpose, so the layout change
    # to [K, M] moves 32-bit words, not single bytes (the compiler moved `_quantize_cols`'s to
    # the FP8 codes: 64 `st.shared.b8` a thread on sm_90). Tile row i is token r(i) =
    # 4 (i % 16) + (i // 16) % 4 + 64 (i // 64): the rows one thread holds (16 apart in a
    # 128-row tile loaded along K) are then 4 consecutive tokens. The amax is a max over the
    # same values, the codes the same: the same bits.
    tl.static_assert(TM == 128, "the packed 128x1 tile's token permutation is 2 x 4 x 16 rows")
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    i = tl.arange(0, TM)
    rows = pid_m.to(tl.int64) * TM + 4 * (i % 16) + (i // 16) % 4 + 64 * (i // 64)
    cols = pid_k.to(tl.int64) * TK + tl.arange(0, TK)
    cmask = cols < K
    q, sinv, _ = _quantize_col_tile(x_ptr, rows, cols, cmask, M, sxm, sxk, FMAX, MAXV, EPS, POW2,
                                    MANT, BIAS, NATIVE, FP8, IN_BF16)  # fmt: skip
    q4 = tl.reshape(q.to(tl.int32), [2, 4, 16, TK])  # [i // 64, (i // 16) % 4, i % 16, col]
    words = tl.sum(q4 << (tl.arange(0, 4) * 8)[None, :, None, None], axis=1)  # disjoint bytes
    word = pid_m.to(tl.int64) * (TM // 4) + 16 * tl.arange(0, 2)[:, None, None]
    word = word + tl.arange(0, 16)[None, :, None]  # tokens 4 word .. 4 word + 3
    wmask = (word < sqk) & cmask[None, None, :]  # sqk = M // 4: 4 words' mask provably equal
    tl.store(q_ptr + cols[None, None, :] * sqk + word, words, mask=wmask)
    tl.store(s_ptr + pid_m * ssm + cols * ssk, sinv, mask=cmask)
    flag_non_finite(flag_ptr, sinv, FLAG)


@triton.jit
def _quantize_col_tile(x_ptr, rows, cols, cmask, M, sxm, sxk, FMAX: tl.constexpr,
                       MAXV: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                       MANT: tl.constexpr, BIAS: tl.constexpr, NATIVE: tl.constexpr,
                       FP8: tl.constexpr, IN_BF16: tl.constexpr):  # fmt: skip
    # Rows ``rows`` (in any order: a column's amax is a max) x columns ``cols`` read once and
    # quantized as 128x1 blocks, one per column: (codes, scale_inv per column, the load mask).
    mask = (rows < M)[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask, other=0.0)
    q, sinv = quantize_blocks(to_fp32(x, IN_BF16), COLS, FMAX, MAXV, EPS, POW2, MANT, BIAS,
                              NATIVE, FP8)  # fmt: skip
    return q, sinv, mask


@triton.jit
def _store_cols(q_ptr, qt_ptr, q, rows, cols, mask, M, sqm, sqk, WRITE_T: tl.constexpr):
    tl.store(q_ptr + rows[:, None] * sqm + cols[None, :] * sqk, q, mask=mask)
    if WRITE_T:  # the same codes again as a contiguous [K, M]
        tl.store(qt_ptr + cols[None, :] * M + rows[:, None], q, mask=mask)


@triton.jit
def rmsnorm_quantize_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    q_ptr,
    s_ptr,
    flag_ptr,
    M,
    K,
    sxm,
    sym,
    sqm,
    ssm,
    ssk,
    NORM_EPS,
    TM: tl.constexpr,
    OUT_BF16: tl.constexpr,
    FLAG: tl.constexpr,
    FMAX: tl.constexpr,
    MAXV: tl.constexpr,
    EPS: tl.constexpr,
    POW2: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    NATIVE: tl.constexpr,
    FP8: tl.constexpr,
    IN_BF16: tl.constexpr,
):
    # y = x * rsqrt(mean(x^2) + eps) * w, rounded once to the output dtype; then y is
    # quantized 1x128 exactly as quantize_blockwise(y) would (from the rounded y).
    pid_m = tl.program_id(0)
    rows = pid_m.to(tl.int64) * TM + tl.arange(0, TM)
    rmask = rows < M
    acc = tl.zeros([TM], dtype=tl.float32)
    for k0 in range(0, K, 128):
        cols = k0 + tl.arange(0, 128)
        mask = rmask[:, None] & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :], mask=mask, other=0.0)
        x = to_fp32(x, IN_BF16)
        acc += tl.sum(x * x, axis=1)
    ms = tl.math.div_rn(acc, tl.zeros_like(acc) + K)
    rstd = tl.math.div_rn(tl.zeros_like(acc) + 1.0, tl.math.sqrt_rn(ms + NORM_EPS))
    for k0 in range(0, K, 128):
        cols = k0 + tl.arange(0, 128)
        cmask = cols < K
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :], mask=mask, other=0.0)
        w = to_fp32(tl.load(w_ptr + cols, mask=cmask, other=0.0), IN_BF16)
        y = (to_fp32(x, IN_BF16) * rstd[:, None]) * w[None, :]
        if OUT_BF16:
            hi = bf16_rne_bits(y)  # RNE (the interpreter's own bf16 conversion truncates)
            tl.store(y_ptr + rows[:, None] * sym + cols[None, :], hi.to(tl.int16), mask=mask)
            yr = (hi << 16).to(tl.float32, bitcast=True)
        else:
            yh = y.to(tl.float16)
            tl.store(y_ptr + rows[:, None] * sym + cols[None, :], yh, mask=mask)
            yr = yh.to(tl.float32)
        yr = tl.where(mask, yr, 0.0)
        q, sinv = quantize_blocks(yr, ROWS, FMAX, MAXV, EPS, POW2, MANT, BIAS, NATIVE, FP8)
        tl.store(q_ptr + rows[:, None] * sqm + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows * ssm + (k0 // 128) * ssk, sinv, mask=rmask)
        flag_non_finite(flag_ptr, sinv, FLAG)


@triton.jit
def quantize_rowcol_kernel(
    x_ptr,
    qr_ptr,
    sr_ptr,
    qc_ptr,
    sc_ptr,
    flag_ptr,
    M,
    K,
    MP,
    KP,
    sxm,
    sxk,
    ssrm,
    ssrk,
    sscm,
    ssck,
    FLAG: tl.constexpr,
    FMAX: tl.constexpr,
    MAXV: tl.constexpr,
    EPS: tl.constexpr,
    POW2: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    NATIVE: tl.constexpr,
    FP8: tl.constexpr,
    IN_BF16: tl.constexpr,
    CHUNK: tl.constexpr,
    STAGES: tl.constexpr,
):
    # Each 128 x 128 tile of x quantized twice (TE's cast+transpose):
    # rowwise: 128 1x128 blocks -> qr [M, K] row-major, sr[m, k // 128];
    # columnwise: 128 128x1 blocks -> qc [K, M] (x.T, contiguous; 1x128 blocks of x.T), sc[k, m // 128].
    # Rows past M load 0, which changes no column amax: a partial tile is the partial block.
    # MP / KP: the scale arrays' padded extents (mn_major pads M and K to 4): zeros stored there.
    # Program p takes tiles p, p + P, p + 2P, ... (P programs, row-major tile order).
    # CHUNK == 128: the tile is read once and held in registers for both quantizations (~250
    # registers a thread at 8 warps: one program per SM). CHUNK < 128: the rows are quantized
    # CHUNK at a time while the column amax accumulates (a max of maxes: the same amax), then
    # read again (from L2, just read) for the columns; few registers, so several programs share
    # an SM, and STAGES > 1 pipelines each loop's loads. The same bits either way.
    n_k = tl.cdiv(K, 128)
    n_tiles = tl.cdiv(M, 128) * n_k
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        pid_m = t // n_k
        pid_k = t - pid_m * n_k
        cols = pid_k.to(tl.int64) * 128 + tl.arange(0, 128)
        cmask = cols < K
        if CHUNK == 128:
            rows = pid_m.to(tl.int64) * 128 + tl.arange(0, 128)
            x = _rowcol_rows(x_ptr, qr_ptr, sr_ptr, flag_ptr, rows, cols, pid_k, M, K, MP, sxm,
                             sxk, ssrm, ssrk, FLAG, FMAX, MAXV, EPS, POW2, MANT, BIAS, NATIVE,
                             FP8, IN_BF16)  # fmt: skip
            qc, sc = quantize_blocks(x, COLS, FMAX, MAXV, EPS, POW2, MANT, BIAS, NATIVE, FP8)
            _rowcol_store_cols(qc_ptr, qc, rows, cols, M, K)
        else:
            amax = tl.zeros([128], dtype=tl.int32)
            for r in tl.range(0, 128, CHUNK, num_stages=STAGES):
                rows = pid_m.to(tl.int64) * 128 + r + tl.arange(0, CHUNK)
                x = _rowcol_rows(x_ptr, qr_ptr, sr_ptr, flag_ptr, rows, cols, pid_k, M, K, MP,
                                 sxm, sxk, ssrm, ssrk, FLAG, FMAX, MAXV, EPS, POW2, MANT, BIAS,
                                 NATIVE, FP8, IN_BF16)  # fmt: skip
                amax = tl.maximum(amax, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0))
            scale = block_scale(amax, FMAX, MAXV, EPS, POW2)
            sc = finish_scale_inv(scale, amax)
            for r in tl.range(0, 128, CHUNK, num_stages=STAGES):
                rows = pid_m.to(tl.int64) * 128 + r + tl.arange(0, CHUNK)
                mask = (rows < M)[:, None] & cmask[None, :]
                x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask, other=0.0)
                x = to_fp32(x, IN_BF16)
                qc = quantize_values(x, scale[None, :], FMAX, MANT, BIAS, NATIVE, FP8)
                _rowcol_store_cols(qc_ptr, qc, rows, cols, M, K)
        tl.store(sc_ptr + cols * sscm + pid_m * ssck, tl.where(cmask, sc, 0.0), mask=cols < KP)


@triton.jit
def _rowcol_rows(x_ptr, qr_ptr, sr_ptr, flag_ptr, rows, cols, pid_k, M, K, MP, sxm, sxk, ssrm,
                 ssrk, FLAG: tl.constexpr, FMAX: tl.constexpr, MAXV: tl.constexpr,
                 EPS: tl.constexpr, POW2: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
                 NATIVE: tl.constexpr, FP8: tl.constexpr, IN_BF16: tl.constexpr):  # fmt: skip
    # Load rows x cols of x, store their 1x128 quantization (codes, scale_inv, flag); return
    # the fp32 values for the columnwise one.
    rmask = rows < M
    mask = rmask[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask, other=0.0)
    x = to_fp32(x, IN_BF16)
    qr, sr = quantize_blocks(x, ROWS, FMAX, MAXV, EPS, POW2, MANT, BIAS, NATIVE, FP8)
    tl.store(qr_ptr + rows[:, None] * K + cols[None, :], qr, mask=mask)
    tl.store(sr_ptr + rows * ssrm + pid_k * ssrk, tl.where(rmask, sr, 0.0), mask=rows < MP)
    flag_non_finite(flag_ptr, sr, FLAG)  # every element is in one row block
    return x


@triton.jit
def _rowcol_store_cols(qc_ptr, qc, rows, cols, M, K):
    # The codes of rows x cols stored into qc = [K, M] as the transposed tile, so consecutive
    # lanes write consecutive bytes of qc's rows.
    tmask = (cols < K)[:, None] & (rows < M)[None, :]  # built directly: no transpose of an i1
    tl.store(qc_ptr + cols[:, None] * M + rows[None, :], tl.trans(qc), mask=tmask)
