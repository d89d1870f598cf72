"""The jitted grouped-expert kernels behind `nemo_jetrl.fp8.triton_grouped` (read its docstring).

Imports triton at its top like `_triton_jit`; only `triton_grouped._kernels()` imports it. The
quantization and FP8-operand helpers are `_triton_common`'s, the one home the dense kernels
share (imported into this module's globals, where Triton resolves the names a kernel calls).
"""

import triton
import triton.language as tl

from nemo_jetrl.fp8._triton_common import quantize_cols, tile_dot, to_fp32


@triton.jit
def _find_group(starts_ptr, pid, E, E_POW2: tl.constexpr):
    # The group g (expert) whose range [starts[g], starts[g+1]) holds pid: the number of groups
    # ending at or before pid. g == E means pid is past the last group (an idle program).
    ex = tl.arange(0, E_POW2)
    ends = tl.load(starts_ptr + 1 + ex, mask=ex < E, other=0)
    g = tl.sum(((ends <= pid) & (ex < E)).to(tl.int32), axis=0)
    return tl.minimum(g, E - 1).to(tl.int64), g < E


@triton.jit
def quantize_tokens_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    off_ptr,
    boff_ptr,
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
):
    # Program (b, c): block column b of the grouped layout (expert e's block b - boff[e], which
    # starts at token off[e] + 128 * (b - boff[e])) for TC channels. Writes codes transposed
    # ([C, M]) and one scale per channel in column b.
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    e, valid = _find_group(boff_ptr, pid_b, E, E_POW2)
    r0 = tl.load(off_ptr + e) + (pid_b - tl.load(boff_ptr + e)) * 128
    r1 = tl.where(valid, tl.load(off_ptr + e + 1), r0)  # an idle program touches nothing
    rows = r0 + tl.arange(0, 128)
    cols = pid_c.to(tl.int64) * TC + tl.arange(0, TC)
    cmask = cols < tl.where(valid, C, 0)
    mask = (rows < r1)[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxc, mask=mask, other=0.0)
    x = to_fp32(x, IN_BF16)
    q, sinv = quantize_cols(x, FMAX, MAXV, EPS, POW2, MANT, BIAS, NATIVE, FP8)
    tl.store(s_ptr + cols * ssc + pid_b, sinv, mask=cmask)
    tl.store(q_ptr + cols[None, :] * sqc + rows[:, None], q, mask=mask)


@triton.jit
def grouped_rows_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sa_ptr,
    sb_ptr,
    lut_a_ptr,
    lut_b_ptr,
    off_ptr,
    toff_ptr,
    E,
    N,
    K,
    sam,
    sak,
    sbe,
    sbn,
    sbk,
    scm,
    scn,
    ssam,
    ssak,
    ssbe,
    ssbn,
    ssbk,
    BM: tl.constexpr,
    BN: tl.constexpr,
    E_POW2: tl.constexpr,
    NATIVE: tl.constexpr,
    TF32: tl.constexpr,
    FP8_A: tl.constexpr,
    FP8_B: tl.constexpr,
):
    # Program (t, n): row tile t of the grouped schedule (expert e's tile t - toff[e], rows from
    # off[e] + BM * (t - toff[e]), never past off[e+1]) times BN output columns:
    #   C[m, n] = sum over 128-wide K tiles k of fma(p_k * sa[m, k], sb_e[n // 128, k], acc)
    # with B = expert e's 128x128-blocked [N, K] operand (W for FProp, W.t() for DGrad).
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, valid = _find_group(toff_ptr, pid_t, E, E_POW2)
    r0 = tl.load(off_ptr + e) + (pid_t - tl.load(toff_ptr + e)) * BM
    r1 = tl.where(valid, tl.load(off_ptr + e + 1), r0)  # an idle program touches nothing
    rm = r0 + tl.arange(0, BM)
    mmask = rm < r1
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, 128).to(tl.int64)
    b_ptr += e * sbe
    sb_ptr += e * ssbe
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_tiles = tl.where(valid, tl.cdiv(K, 128), 0)  # an idle program runs no tile
    for t in range(0, k_tiles):
        k = t * 128 + rk
        a = tl.load(
            a_ptr + rm[:, None] * sam + k[None, :] * sak,
            mask=mmask[:, None] & (k[None, :] < K),
            other=0,
        )
        b = tl.load(
            b_ptr + rn[None, :] * sbn + k[:, None] * sbk,
            mask=(rn[None, :] < N) & (k[:, None] < K),
            other=0,
        )
        p = tile_dot(a, b, lut_a_ptr, lut_b_ptr, NATIVE, TF32, FP8_A, FP8_B)
        sa = tl.load(sa_ptr + rm * ssam + t * ssak, mask=mmask, other=0.0)
        sb = tl.load(sb_ptr + (rn // 128) * ssbn + t * ssbk, mask=rn < N, other=0.0)
        acc = tl.fma(p * sa[:, None], sb[None, :], acc)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(
        c_ptr + rm[:, None] * scm + rn[None, :] * scn,
        c,
        mask=mmask[:, None] & (rn[None, :] < N),
    )


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
):
    # Program (e, m, n): WGrad of expert e, C[e] = A_e @ B_e.T where A = dY.T [N, M] and
    # B = X.T [K, M] are blocked 1x128 along tokens per expert: token tile t of expert e is
    # tokens off[e] + 128t ... (short at its end) and its scales sit in column boff[e] + t.
    e = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    t0 = tl.load(off_ptr + e)
    t1 = tl.load(off_ptr + e + 1)
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
        acc = tl.fma(p * sa[:, None], sb[None, :], acc)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(
        c_ptr + e * sce + rm[:, None] * scm + rn[None, :] * scn,
        c,
        mask=(rm[:, None] < N) & (rn[None, :] < K),
    )
