"""The jitted Triton kernels behind `nemo_jetrl.fp8.triton_kernels` (read that module's docstring).

This module imports triton at its top because Triton resolves the helpers a kernel calls through
module globals. Only `triton_kernels._kernels()` imports it, after checking triton is installed,
so `nemo_jetrl.fp8` itself never needs triton.
"""

import triton
import triton.language as tl


@triton.jit
def encode_fp8(v, MANT: tl.constexpr, BIAS: tl.constexpr):
    # RNE fp32 -> FP8 bits for finite |v| <= fmax (clamped by the caller).
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal range: round the fp32 pattern to MANT mantissa bits (a carry may bump the
    # exponent, which is correct), then rebias the exponent.
    normal = ((a + ((1 << (22 - MANT)) - 1) + ((a >> (23 - MANT)) & 1)) >> (23 - MANT)) - (
        (127 - BIAS) << MANT
    )
    # Subnormal range: count steps of 2**(1-BIAS-MANT), rounding the integer to nearest even.
    # Shifts are capped at 25: the value is then below half a step and rounds to 0.
    e = (a >> 23) - 127
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(24 - BIAS - MANT - e, 25)
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.to(tl.int32)
    res = tl.where(e < 1 - BIAS, sub, normal)
    return (res | sign).to(tl.uint8)


@triton.jit
def to_fp32(x, IN_BF16: tl.constexpr):
    # bf16 arrives as its int16 bit pattern: widening is a 16-bit shift, exact for subnormals
    # too (the interpreter's own bf16 -> fp32 conversion mangles them).
    if IN_BF16:
        return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def block_scale(
    amax_bits,
    FMAX: tl.constexpr,
    MAXV: tl.constexpr,
    EPS: tl.constexpr,
    POW2: tl.constexpr,
):
    # The spec's scale rule from the integer pattern of the block amax.
    amax = amax_bits.to(tl.float32, bitcast=True)
    amax = tl.maximum(amax, EPS)
    s = tl.math.div_rn(tl.zeros_like(amax) + FMAX, amax)
    s = tl.where(s.to(tl.int32, bitcast=True) == 0x7F800000, MAXV, s)
    if POW2:
        s = (s.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    return tl.where(amax == 0.0, 1.0, s)


@triton.jit
def quantize_values(
    x,
    scale,
    FMAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    NATIVE: tl.constexpr,
    FP8: tl.constexpr,
):
    v = x * scale
    v = tl.minimum(tl.maximum(v, -FMAX), FMAX)
    if NATIVE:
        return v.to(FP8).to(tl.uint8, bitcast=True)
    return encode_fp8(v, MANT, BIAS)


@triton.jit
def finish_scale_inv(scale, amax_bits):
    # 1/scale (exact in pow2 mode); a non-finite block (amax pattern inf or NaN) stores NaN.
    sinv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
    nan = ((amax_bits & 0) | 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where(amax_bits >= 0x7F800000, nan, sinv)


@triton.jit
def quantize_rows(
    x,
    FMAX: tl.constexpr,
    MAXV: tl.constexpr,
    EPS: tl.constexpr,
    POW2: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    NATIVE: tl.constexpr,
    FP8: tl.constexpr,
):
    # Each row of the fp32 tile x [TM, 128] is one 1x128 block: (FP8 codes, scale_inv per row).
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    scale = block_scale(amax_bits, FMAX, MAXV, EPS, POW2)
    q = quantize_values(x, scale[:, None], FMAX, MANT, BIAS, NATIVE, FP8)
    return q, finish_scale_inv(scale, amax_bits)


@triton.jit
def quantize_cols(
    x,
    FMAX: tl.constexpr,
    MAXV: tl.constexpr,
    EPS: tl.constexpr,
    POW2: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    NATIVE: tl.constexpr,
    FP8: tl.constexpr,
):
    # Each column of the fp32 tile x [128, TK] is one 128x1 block: (codes, scale_inv per column).
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)
    scale = block_scale(amax_bits, FMAX, MAXV, EPS, POW2)
    q = quantize_values(x, scale[None, :], FMAX, MANT, BIAS, NATIVE, FP8)
    return q, finish_scale_inv(scale, amax_bits)


@triton.jit
def quantize_kernel(
    x_ptr,
    q_ptr,
    qt_ptr,
    s_ptr,
    M,
    K,
    sxm,
    sxk,
    sqm,
    sqk,
    ssm,
    ssk,
    MODE: tl.constexpr,
    WRITE_T: tl.constexpr,
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
):
    # One program quantizes a TM x TK tile made of whole blocks:
    # MODE 0: TM rows x 128 (one 1x128 block per row); 1: one 128x128 block;
    # 2: 128 x TK (one 128x1 block per column).
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m.to(tl.int64) * TM + tl.arange(0, TM)
    cols = pid_k.to(tl.int64) * TK + tl.arange(0, TK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask, other=0.0)
    x = to_fp32(x, IN_BF16)
    if MODE == 0:
        q, sinv = quantize_rows(x, FMAX, MAXV, EPS, POW2, MANT, BIAS, NATIVE, FP8)
        tl.store(s_ptr + rows * ssm + pid_k * ssk, sinv, mask=rows < M)
    elif MODE == 1:
        abits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        amax_bits = tl.max(tl.max(abits, axis=1), axis=0)
        scale = block_scale(amax_bits, FMAX, MAXV, EPS, POW2)
        q = quantize_values(x, scale, FMAX, MANT, BIAS, NATIVE, FP8)
        tl.store(s_ptr + pid_m * ssm + pid_k * ssk, finish_scale_inv(scale, amax_bits))
    else:
        q, sinv = quantize_cols(x, FMAX, MAXV, EPS, POW2, MANT, BIAS, NATIVE, FP8)
        tl.store(s_ptr + pid_m * ssm + cols * ssk, sinv, mask=cols < K)
    tl.store(q_ptr + rows[:, None] * sqm + cols[None, :] * sqk, q, mask=mask)
    if WRITE_T:  # the same codes again as a contiguous [K, M] (DGrad's weight operand)
        tl.store(qt_ptr + cols[None, :] * M + rows[:, None], q, mask=mask)


@triton.jit
def rmsnorm_quantize_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    q_ptr,
    s_ptr,
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
            # fp32 -> bf16 round-to-nearest-even on the bit pattern (the interpreter's own
            # bf16 conversion truncates); then back to fp32 exactly.
            # NaN maps to 0x7FC0 as torch's conversion does: a GPU's canonical NaN 0x7FFFFFFF
            # would overflow the rounding add into -0.0 and hide the NaN from the check.
            b = y.to(tl.int32, bitcast=True)
            hi = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            hi = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, hi)
            tl.store(y_ptr + rows[:, None] * sym + cols[None, :], hi.to(tl.int16), mask=mask)
            yr = (hi << 16).to(tl.float32, bitcast=True)
        else:
            yh = y.to(tl.float16)
            tl.store(y_ptr + rows[:, None] * sym + cols[None, :], yh, mask=mask)
            yr = yh.to(tl.float32)
        yr = tl.where(mask, yr, 0.0)
        q, sinv = quantize_rows(yr, FMAX, MAXV, EPS, POW2, MANT, BIAS, NATIVE, FP8)
        tl.store(q_ptr + rows[:, None] * sqm + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows * ssm + (k0 // 128) * ssk, sinv, mask=rmask)
