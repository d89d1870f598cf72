"""The one home of the @triton.jit helpers the quantizer, dense GEMM and grouped kernels share.

`_triton_jit` (quantizers), `_triton_gemm_jit` (dense block GEMM) and `_triton_grouped_jit`
(grouped experts) import these names into their own globals, where Triton resolves the helpers a
kernel calls. Like them this module imports triton at its top; only those modules import it.

Every helper has one `return` (a constexpr branch assigns, then one return): the compiler types
every return statement it reaches, so two returns of different types compile-fail even though
Triton's CPU interpreter accepts them. No helper uses `/` (approximate on NVIDIA GPUs): divisions
are `tl.math.div_rn`.
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
    if IN_BF16:  # noqa: SIM108 (a statement-level constexpr branch: only the taken one compiles)
        v = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        v = x.to(tl.float32)
    return v


@triton.jit
def bf16_rne_bits(y):
    # fp32 -> bf16 round-to-nearest-even on the bit pattern (the interpreter's own bf16
    # conversion truncates), as int32 holding the 16 bf16 bits. NaN maps to 0x7FC0 as torch's
    # conversion does: a GPU's canonical NaN 0x7FFFFFFF would overflow the rounding add into
    # -0.0 and hide the NaN from the finiteness check.
    b = y.to(tl.int32, bitcast=True)
    hi = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, hi)


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
    # NATIVE: the hardware cvt.rn.satfinite (same codes as encode_fp8 on every finite input,
    # measured on H100/H200; DESIGN.md "GPU facts"); else the integer encode (the reference).
    v = x * scale
    v = tl.minimum(tl.maximum(v, -FMAX), FMAX)
    if NATIVE:  # noqa: SIM108 (a statement-level constexpr branch: only the taken one compiles)
        q = v.to(FP8).to(tl.uint8, bitcast=True)
    else:
        q = encode_fp8(v, MANT, BIAS)
    return q


@triton.jit
def finish_scale_inv(scale, amax_bits):
    # 1/scale (exact in pow2 mode); a non-finite block (amax pattern inf or NaN) stores NaN.
    sinv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
    nan = ((amax_bits & 0) | 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where(amax_bits >= 0x7F800000, nan, sinv)


# quantize_blocks' AXIS: ROWS makes each row of a [TM, 128] tile one 1x128 block, COLS each
# column of a [128, TK] tile one 128x1 block (module constexprs, so kernels pass them by name).
ROWS = tl.constexpr(1)
COLS = tl.constexpr(0)


@triton.jit
def quantize_blocks(
    x,
    AXIS: tl.constexpr,
    FMAX: tl.constexpr,
    MAXV: tl.constexpr,
    EPS: tl.constexpr,
    POW2: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    NATIVE: tl.constexpr,
    FP8: tl.constexpr,
):
    # The fp32 tile x quantized in blocks along AXIS (ROWS: one block per row, COLS: one per
    # column): (FP8 codes, scale_inv per block). expand_dims(scale, AXIS) is scale[:, None] for
    # ROWS and scale[None, :] for COLS.
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=AXIS)
    scale = block_scale(amax_bits, FMAX, MAXV, EPS, POW2)
    q = quantize_values(x, tl.expand_dims(scale, AXIS), FMAX, MANT, BIAS, NATIVE, FP8)
    return q, finish_scale_inv(scale, amax_bits)


@triton.jit
def flag_non_finite(flag_ptr, sinv, FLAG: tl.constexpr):
    # The non-finite marker the quantizer already computes (a NaN scale_inv) folded into the
    # caller's int32 flag: 1 when any block of this tile had NaN/inf. Every writer stores the
    # same value, so concurrent programs need no atomics; no store at all when all is finite.
    if FLAG:
        bad = tl.max((sinv != sinv).to(tl.int32), axis=0)
        tl.store(flag_ptr, bad, mask=bad != 0)


@triton.jit
def _operand(codes, lut_ptr, NATIVE: tl.constexpr, FP8: tl.constexpr):
    # FP8 codes (uint8) as values the dot consumes: the FP8 type itself (tensor cores, SM89+),
    # or fp32 from a 256-entry table (exact; any GPU and Triton's CPU interpreter).
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
def scaled_accumulate(acc, p, sa, sb):
    # The TE/cuBLAS accumulation step of a block-scaled GEMM: acc = fma(p_t * sa, sb, acc) with
    # sa per output row and sb per output column (every GEMM kernel rounds in this order).
    return tl.fma(p * sa[:, None], sb[None, :], acc)
