"""The jitted block-scaled FP8 GEMM behind `nemo_jetrl.fp8.triton_gemm` (read its docstring).

Imports triton at its top like `_triton_jit`; only `triton_gemm._kernel()` imports it. The FP8
operand and accumulation helpers are `_triton_common`'s (shared with the grouped kernels).
"""

import triton
import triton.language as tl

from nemo_jetrl.fp8._triton_common import scaled_accumulate, tile_dot


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
            other=0.0,
        )
        b = tl.load(
            b_ptr + rn[None, :] * sbn + k[:, None] * sbk,
            mask=(rn[None, :] < N) & (k[:, None] < K),
            other=0.0,
        )
        p = tile_dot(a, b, lut_a_ptr, lut_b_ptr, NATIVE, TF32, FP8_A, FP8_B)
        sa = tl.load(sa_ptr + rm * ssam + t * ssak, mask=rm < M, other=0.0)
        sb = tl.load(sb_ptr + (rn // B_ROWS) * ssbn + t * ssbk, mask=rn < N, other=0.0)
        acc = scaled_accumulate(acc, p, sa, sb)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(
        c_ptr + rm[:, None] * scm + rn[None, :] * scn,
        c,
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )
