"""The jitted block-scaled FP8 GEMM behind `nemo_jetrl.fp8.triton_gemm` (read its docstring).

Imports triton at its top like `_triton_jit`; only `triton_gemm._kernel()` imports it.
"""

import triton
import triton.language as tl


@triton.jit
def _operand(codes, lut_ptr, NATIVE: tl.constexpr, FP8: tl.constexpr):
    # FP8 codes (uint8) as values the dot consumes: the FP8 type itself (tensor cores, SM89+),
    # or fp32 from a 256-entry table (exact; any GPU and Triton's CPU interpreter). One return:
    # the compiler types every return statement it reaches, and a constexpr `if` that returns
    # early still lets it reach the one after (fp8 vs fp32: "Inconsistent return types").
    if NATIVE:  # noqa: SIM108 (a statement-level constexpr branch: only the taken one compiles)
        v = codes.to(FP8, bitcast=True)
    else:
        v = tl.load(lut_ptr + codes.to(tl.int32))
    return v


@triton.jit
def tile_dot(
    a,
    b,
    lut_a_ptr,
    lut_b_ptr,
    NATIVE: tl.constexpr,
    TF32: tl.constexpr,
    FP8_A: tl.constexpr,
    FP8_B: tl.constexpr,
):
    # p_t, the fp32 dot of one 128-wide K tile of FP8 codes (shared by the dense and grouped
    # GEMMs, so every kernel forms its partial products the same way).
    av = _operand(a, lut_a_ptr, NATIVE, FP8_A)
    bv = _operand(b, lut_b_ptr, NATIVE, FP8_B)
    if NATIVE:
        p = tl.dot(av, bv, out_dtype=tl.float32)
    elif TF32:
        # Exact: every FP8 value fits TF32's 10-bit mantissa and its exponent range.
        p = tl.dot(av, bv, input_precision="tf32", out_dtype=tl.float32)
    else:
        p = tl.dot(av, bv, input_precision="ieee", out_dtype=tl.float32)
    return p


@triton.jit
def block_fp8_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sa_ptr,
    sb_ptr,
    lut_a_ptr,
    lut_b_ptr,
    M,
    N,
    K,
    sam,
    sak,
    sbn,
    sbk,
    scm,
    scn,
    ssam,
    ssak,
    ssbn,
    ssbk,
    B_ROWS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    NATIVE: tl.constexpr,
    TF32: tl.constexpr,
    FP8_A: tl.constexpr,
    FP8_B: tl.constexpr,
):
    # C[m, n] = sum over 128-wide K tiles t of the TE/cuBLAS accumulation step
    #   acc = fma(p_t * sa[m, t], sb[n // B_ROWS, t], acc),  p_t = fp32 dot of tile t.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    # int64 like rm/rn: WGrad's transposed views have sak = N_out, sbk = K_in, and k * sak
    # passes 2**31 at ~150k tokens of a 14336-wide layer (int32 would wrap).
    rk = tl.arange(0, 128).to(tl.int64)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for t in range(0, tl.cdiv(K, 128)):
        k = t * 128 + rk
        a = tl.load(
            a_ptr + rm[:, None] * sam + k[None, :] * sak,
            mask=(rm[:, None] < M) & (k[None, :] < K),
            other=0,
        )
        b = tl.load(
            b_ptr + rn[None, :] * sbn + k[:, None] * sbk,
            mask=(rn[None, :] < N) & (k[:, None] < K),
            other=0,
        )
        p = tile_dot(a, b, lut_a_ptr, lut_b_ptr, NATIVE, TF32, FP8_A, FP8_B)
        sa = tl.load(sa_ptr + rm * ssam + t * ssak, mask=rm < M, other=0.0)
        sb = tl.load(sb_ptr + (rn // B_ROWS) * ssbn + t * ssbk, mask=rn < N, other=0.0)
        acc = tl.fma(p * sa[:, None], sb[None, :], acc)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(
        c_ptr + rm[:, None] * scm + rn[None, :] * scn,
        c,
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )
