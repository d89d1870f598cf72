"""The jitted grouped-expert kernels behind `nemo_jetrl.fp8.triton_grouped` (read its docstring).

Imports triton at its top like `_triton_jit`; only `triton_grouped._kernels()` imports it. The
quantization and FP8-operand helpers are `_triton_common`'s, the one home the dense kernels
share (imported into this module's globals, where Triton resolves the names a kernel calls).
The SiLU rule's constants are `silu_mul`'s (one home), bound here as ``tl.constexpr`` globals.
The grouped rows GEMM lives in `_triton_grouped_gemm_jit` and is re-exported here, so every
grouped kernel is reached through `triton_grouped._kernels()`.
"""

import triton
import triton.language as tl

from nemo_jetrl.fp8 import silu_mul as _rule
from nemo_jetrl.fp8._triton_common import (
    COLS,
    ROWS,
    bf16_rne_bits,
    quantize_blocks,
    scaled_accumulate,
    tile_dot,
    to_fp32,
)
from nemo_jetrl.fp8._triton_grouped_gemm_jit import grouped_rows_gemm_kernel  # noqa: F401

LOG2E = tl.constexpr(_rule.LOG2E)
LN2_HI = tl.constexpr(_rule.LN2_HI)
LN2_LO = tl.constexpr(_rule.LN2_LO)
EXP_MAX = tl.constexpr(_rule.EXP_MAX)
EXP_MIN = tl.constexpr(_rule.EXP_MIN)
C0, C1, C2, C3 = (tl.constexpr(c) for c in _rule.TAYLOR[:4])
C4, C5, C6, C7 = (tl.constexpr(c) for c in _rule.TAYLOR[4:])
RNE_SHIFT = tl.constexpr(12582912.0)  # 1.5 * 2**23: (t + it) - it rounds |t| < 2**22 to even


@triton.jit
def _find_group(starts_ptr, pid, E, E_POW2: tl.constexpr):
    # The group g (expert) whose range [starts[g], starts[g+1]) holds pid: the number of groups
    # ending at or before pid. g == E means pid is past the last group (an idle program).
    ex = tl.arange(0, E_POW2)
    ends = tl.load(starts_ptr + 1 + ex, mask=ex < E, other=0)
    g = tl.sum(((ends <= pid) & (ex < E)).to(tl.int32), axis=0)
    return tl.minimum(g, E - 1).to(tl.int64), g < E


@triton.jit
def _group_tile(off_ptr, toff_ptr, pid, E, E_POW2: tl.constexpr, TILE: tl.constexpr):
    # Program pid's tile of a grouped schedule: group e (tiles toff[e].. of TILE rows each), its
    # first row r0 = off[e] + TILE * (pid - toff[e]) and end r1 = off[e+1] (r0 for an idle
    # program, which then touches nothing).
    e, valid = _find_group(toff_ptr, pid, E, E_POW2)
    r0 = tl.load(off_ptr + e) + (pid - tl.load(toff_ptr + e)) * TILE
    r1 = tl.where(valid, tl.load(off_ptr + e + 1), r0)
    return e, valid, r0, r1


@triton.jit
def quantize_tokens_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    off_ptr,
    boff_ptr,
    poff_ptr,
    E,
    C,
    sxm,
    sxc,
    sqc,
    ssc,
    TC: tl.constexpr,
    E_POW2: tl.constexpr,
    FMAX: tl.constexpr,
    MAXV: tl.constexpr,
    EPS: tl.constexpr,
    POW2: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    NATIVE: tl.constexpr,
    FP8: tl.constexpr,
    IN_BF16: tl.constexpr,
    ALIGN: tl.constexpr,
):
    # Program (b, c): block column b of the grouped layout (expert e's block b - boff[e], which
    # starts at token off[e] + 128 * (b - boff[e])) for TC channels. Writes codes transposed
    # ([C, token capacity], expert e's tokens from column poff[e], +0 codes up to its 16-aligned
    # end: the masked rows quantize to +0) and one scale per channel in column b.
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    e, valid, r0, r1 = _group_tile(off_ptr, boff_ptr, pid_b, E, E_POW2, 128)
    rows = r0 + tl.arange(0, 128)
    cols = pid_c.to(tl.int64) * TC + tl.arange(0, TC)
    cmask = cols < tl.where(valid, C, 0)
    mask = (rows < r1)[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxc, mask=mask, other=0.0)
    x = to_fp32(x, IN_BF16)
    q, sinv = quantize_blocks(x, COLS, FMAX, MAXV, EPS, POW2, MANT, BIAS, NATIVE, FP8)
    tl.store(s_ptr + cols * ssc + pid_b, sinv, mask=cmask)
    # The block's first code column: the expert's ALIGN-aligned start (poff[e], ALIGN =
    # grouped_tensors.TOKEN_ALIGN) + 128 per block, so the compiler knows every 16 codes of a
    # channel's row start 16-aligned. Stored as the transposed tile (tokens fastest): each lane
    # writes 16 consecutive codes of one channel, not one byte of 16 channels.
    t0 = tl.multiple_of(tl.load(poff_ptr + e), ALIGN) + (pid_b - tl.load(boff_ptr + e)) * 128
    t1 = tl.multiple_of(tl.load(poff_ptr + e + 1), ALIGN)  # the aligned end (idle: cmask)
    tok = t0 + tl.arange(0, 128)
    tmask = cmask[:, None] & (tok < t1)[None, :]  # built directly: no transpose of an i1 tensor
    tl.store(q_ptr + cols[:, None] * sqc + tok[None, :], tl.trans(q), mask=tmask)


@triton.jit
def grouped_tokens_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sa_ptr,
    sb_ptr,
    lut_a_ptr,
    lut_b_ptr,
    off_ptr,
    boff_ptr,
    N,
    K,
    sam,
    sat,
    sbn,
    sbt,
    sce,
    scm,
    scn,
    ssam,
    ssat,
    ssbn,
    ssbt,
    BM: tl.constexpr,
    BN: tl.constexpr,
    NATIVE: tl.constexpr,
    TF32: tl.constexpr,
    FP8_A: tl.constexpr,
    FP8_B: tl.constexpr,
    ALIGN: tl.constexpr,
):
    # Program (e, m, n): WGrad of expert e, C[e] = A_e @ B_e.T where A = dY.T [N, M] and
    # B = X.T [K, M] are blocked 1x128 along tokens per expert: token tile t of expert e is
    # code columns off[e] + 128t ... (off: the operands' 16-aligned token_offsets; +0 codes
    # after the last token, so the 16-aligned end masks the loads in whole 16-byte vectors) and
    # its scales sit in column boff[e] + t.
    e = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    t0 = tl.multiple_of(tl.load(off_ptr + e), ALIGN)  # ALIGN: grouped_tensors.TOKEN_ALIGN
    t1 = tl.multiple_of(tl.load(off_ptr + e + 1), ALIGN)
    b0 = tl.load(boff_ptr + e)
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    rt = tl.arange(0, 128).to(tl.int64)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for t in range(0, tl.cdiv(t1 - t0, 128)):
        tok = t0 + t * 128 + rt
        tmask = tok < t1
        a = tl.load(
            a_ptr + rm[:, None] * sam + tok[None, :] * sat,
            mask=(rm[:, None] < N) & tmask[None, :],
            other=0,
        )
        b = tl.load(
            b_ptr + rn[None, :] * sbn + tok[:, None] * sbt,
            mask=(rn[None, :] < K) & tmask[:, None],
            other=0,
        )
        p = tile_dot(a, b, lut_a_ptr, lut_b_ptr, NATIVE, TF32, FP8_A, FP8_B)
        sa = tl.load(sa_ptr + rm * ssam + (b0 + t) * ssat, mask=rm < N, other=0.0)
        sb = tl.load(sb_ptr + rn * ssbn + (b0 + t) * ssbt, mask=rn < K, other=0.0)
        acc = scaled_accumulate(acc, p, sa, sb)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(
        c_ptr + e * sce + rm[:, None] * scm + rn[None, :] * scn,
        c,
        mask=(rm[:, None] < N) & (rn[None, :] < K),
    )


@triton.jit
def _portable_exp(x):
    # silu_mul.portable_exp op for op (launched with enable_fp_fusion=False: no mul+add -> fma).
    xc = tl.minimum(tl.maximum(x, EXP_MIN), EXP_MAX)
    n = ((xc * LOG2E) + RNE_SHIFT) - RNE_SHIFT
    r = (xc - n * LN2_HI) - n * LN2_LO
    p = tl.zeros_like(r) + C0
    p = p * r + C1
    p = p * r + C2
    p = p * r + C3
    p = p * r + C4
    p = p * r + C5
    p = p * r + C6
    p = p * r + C7
    k = tl.minimum(tl.maximum(n.to(tl.int32), -252), 254)
    half = k >> 1  # floor(k / 2)
    y = (p * ((half + 127) << 23).to(tl.float32, bitcast=True)) * (((k - half) + 127) << 23).to(
        tl.float32, bitcast=True
    )
    y = tl.where(x > EXP_MAX, float("inf"), y)
    y = tl.where(x < EXP_MIN, 0.0, y)
    return tl.where(x != x, x, y)


@triton.jit
def _round_model(y, MODEL: tl.constexpr):
    # fp32 -> the model dtype (MODEL 0 bf16, 1 fp16, 2 fp32; round to nearest even) -> fp32.
    if MODEL == 0:
        r = (bf16_rne_bits(y) << 16).to(tl.float32, bitcast=True)
    elif MODEL == 1:
        r = y.to(tl.float16).to(tl.float32)
    else:
        r = y
    return r


@triton.jit
def silu_mul_quantize_kernel(
    g_ptr,
    q_ptr,
    s_ptr,
    M,
    INTER,
    sgm,
    sqm,
    ssm,
    TM: tl.constexpr,
    MODEL: tl.constexpr,
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
    # Program (m, j): rows m*TM.. of gate_up [M, 2I] (gate columns 0..I-1, up I..2I-1), the
    # 128 columns of block j: act = round(round(silu(gate)) * up) (silu_mul's rule), then
    # quantized 1x128 as quantize_blockwise(act) would: codes [M, I], scale_inv [M, I/128].
    pid_m = tl.program_id(0)
    pid_j = tl.program_id(1)
    rows = pid_m.to(tl.int64) * TM + tl.arange(0, TM)
    cols = pid_j.to(tl.int64) * 128 + tl.arange(0, 128)
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < INTER)
    base = g_ptr + rows[:, None] * sgm + cols[None, :]
    gate = to_fp32(tl.load(base, mask=mask, other=0), IN_BF16)
    up = to_fp32(tl.load(base + INTER, mask=mask, other=0), IN_BF16)
    one = tl.zeros_like(gate) + 1.0
    s = _round_model(tl.math.div_rn(gate, one + _portable_exp(-gate)), MODEL)
    act = _round_model(s * up, MODEL)
    act = tl.where(mask, act, 0.0)
    q, sinv = quantize_blocks(act, ROWS, FMAX, MAXV, EPS, POW2, MANT, BIAS, NATIVE, FP8)
    tl.store(q_ptr + rows[:, None] * sqm + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows * ssm + pid_j, sinv, mask=rmask)


@triton.jit
def _slot_product(
    y_ptr, w_ptr, pos_ptr, toks, cols, tmask, cmask, spt, syr, j, IN_BF16: tl.constexpr
):
    # y[pos[t, j]] * w[pos[t, j]] in fp32 for the tile's tokens; +0 where the slot is absent.
    r = tl.load(pos_ptr + toks * spt + j, mask=tmask, other=-1)
    here = r >= 0
    rr = tl.where(here, r, 0).to(tl.int64)
    m2 = here[:, None] & cmask[None, :]
    y = to_fp32(tl.load(y_ptr + rr[:, None] * syr + cols[None, :], mask=m2, other=0), IN_BF16)
    w = tl.load(w_ptr + rr, mask=here, other=0.0)
    return tl.where(m2, y * w[:, None], 0.0)


@triton.jit
def combine_kernel(
    y_ptr,
    w_ptr,
    pos_ptr,
    out_ptr,
    T,
    H,
    syr,
    spt,
    sot,
    K: tl.constexpr,
    TT: tl.constexpr,
    BH: tl.constexpr,
    OUT_BF16: tl.constexpr,
    IN_BF16: tl.constexpr,
):
    # Program (t, h): TT tokens x BH columns. Token t's routed rows are pos[t, 0..K-1] (sorted
    # row indices, -1 absent): acc = y[pos0] * w[pos0], then acc = acc + y[pos_j] * w[pos_j]
    # (+0 where absent) in slot order, fp32 products and adds; one rounding to the output.
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    toks = pid_t.to(tl.int64) * TT + tl.arange(0, TT)
    cols = pid_h.to(tl.int64) * BH + tl.arange(0, BH)
    tmask = toks < T
    cmask = cols < H
    acc = _slot_product(y_ptr, w_ptr, pos_ptr, toks, cols, tmask, cmask, spt, syr, 0, IN_BF16)
    for j in tl.static_range(1, K):
        acc = acc + _slot_product(
            y_ptr, w_ptr, pos_ptr, toks, cols, tmask, cmask, spt, syr, j, IN_BF16
        )
    omask = tmask[:, None] & cmask[None, :]
    optr = out_ptr + toks[:, None] * sot + cols[None, :]
    if OUT_BF16:
        tl.store(optr, bf16_rne_bits(acc).to(tl.int16), mask=omask)
    else:
        tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=omask)
