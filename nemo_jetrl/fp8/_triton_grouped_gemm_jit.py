"""The grouped rows GEMM behind `triton_grouped.gemm_rows` (FProp, DGrad, the serving MoE layer).

Imports triton at its top like `_triton_grouped_jit`, which re-exports the kernel (launched
through `triton_grouped._kernels()`). The dot and the accumulation step are `_triton_common`'s (`tile_dot`,
`scaled_accumulate`), the ones every FP8 GEMM kernel shares, so the bits are theirs.

What this kernel adds over a one-tile-per-program grouped GEMM:

* The tile schedule is made on the device by every program from ``offsets`` alone: each
  expert's count of BM-row tiles and their inclusive prefix sum over experts (`_expert_tiles`,
  a ``[E_POW2]`` vector, E <= 256 in the catalog's models): the host launches with no torch op
  around it and reads nothing.
* Persistent programs: a fixed grid (the SM count on a GPU) walks the (row tile, column tile)
  pairs ``pid, pid + nprog, ...`` up to the device-made total; the column tile varies fastest,
  so programs running together share the A rows and the expert's weight in L2.
* The scales of K tile kt + 1 are loaded before tile kt's MMA is issued, so their latency is
  off the path of the scale FMA that follows it; the weight's scale is one scalar a K tile (a
  BN <= 128 column tile lies in one 128-row weight block), not a BN-vector in registers. The
  FMA ``acc = fma(p_t * sa_t, sb_t, acc)`` keeps its order; it overlaps the MMA of another
  program resident on the SM. (Triton waits for a wgmma whose result feeds anything but the
  next wgmma's accumulator, so one program cannot run its own FMA beside its next MMA.)
"""

import triton
import triton.language as tl

from nemo_jetrl.fp8._triton_common import scaled_accumulate, tile_dot


@triton.jit
def _expert_tiles(off_ptr, E, E_POW2: tl.constexpr, BM: tl.constexpr):
    # Per expert lane e < E: where its BM-row tiles start and end in the schedule (exclusive
    # and inclusive prefix sums of ceil(count_e / BM)). Lanes past E hold no tiles.
    ex = tl.arange(0, E_POW2)
    live = ex < E
    lo = tl.load(off_ptr + ex, mask=live, other=0)
    hi = tl.load(off_ptr + ex + 1, mask=live, other=0)
    tiles = (hi - lo + (BM - 1)) // BM
    ends = tl.cumsum(tiles, axis=0)
    return ex, ends - tiles, ends


@triton.jit
def _a_tile(a_ptr, ra, mmask, r0, kt, sam, sak, K, TMA: tl.constexpr):
    # K tile kt of the A rows: through a TMA descriptor over [M, K] (rows past the expert's end
    # are read and never stored; past M they are zeros), else a masked pointer load.
    if TMA:
        a = a_ptr.load([r0.to(tl.int32), kt * 128])
    else:
        k = kt * 128 + tl.arange(0, 128).to(tl.int64)
        a = tl.load(
            a_ptr + ra[:, None] * sam + k[None, :] * sak,
            mask=mmask[:, None] & (k < K)[None, :],
            other=0.0,
        )
    return a


@triton.jit
def _b_tile(b_ptr, e, n0, N, rn, nmask, kt, sbe, sbn, sbk, K, TMA: tl.constexpr):
    # K tile kt of expert e's [N, K] operand as [128, BN]: a TMA descriptor over the [E*N, K]
    # stack (W contiguous), else a masked pointer load through the expert stride.
    if TMA:
        b = tl.trans(b_ptr.load([(e * N + n0).to(tl.int32), kt * 128]))
    else:
        k = kt * 128 + tl.arange(0, 128).to(tl.int64)
        b = tl.load(
            b_ptr + e.to(tl.int64) * sbe + rn[None, :] * sbn + k[:, None] * sbk,
            mask=nmask[None, :] & (k < K)[:, None],
            other=0.0,
        )
    return b


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
    rows_ptr,
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
    GATHER: tl.constexpr,
    NATIVE: tl.constexpr,
    TF32: tl.constexpr,
    FP8_A: tl.constexpr,
    FP8_B: tl.constexpr,
    TMA_A: tl.constexpr,
    TMA_B: tl.constexpr,
):
    # Tile (t, n) of the schedule: row tile t is expert e's tile t - first[e] (rows from
    # off[e] + BM * (t - first[e]), never past off[e+1]) times BN output columns:
    #   C[m, n] = sum over 128-wide K tiles k of fma(p_k * sa[m, k], sb_e[n // 128, k], acc)
    # with B = expert e's 128x128-blocked [N, K] operand (W for FProp, W.t() for DGrad).
    # GATHER: A row m is rows[m] of the operand (the [T, K] input quantized once, read through
    # each routed row's token: no gathered copy); its codes and scale are that row's, unchanged.
    # TMA_A / TMA_B: a_ptr / b_ptr are TMA descriptors ([M, K], [E*N, K]; not with GATHER).
    ex, starts, ends = _expert_tiles(off_ptr, E, E_POW2, BM)
    n_tiles = tl.cdiv(N, BN)
    total = tl.max(ends, axis=0) * n_tiles
    k_tiles = tl.cdiv(K, 128)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        t = tile // n_tiles
        e = tl.sum((ends <= t).to(tl.int32), axis=0)  # tiles of the experts before e end <= t
        r0 = tl.load(off_ptr + e) + (t - tl.sum(tl.where(ex == e, starts, 0), axis=0)) * BM
        r1 = tl.load(off_ptr + e + 1)
        rm = r0 + tl.arange(0, BM)
        mmask = rm < r1
        ra = tl.load(rows_ptr + rm, mask=mmask, other=0).to(tl.int64) if GATHER else rm
        n0 = (tile % n_tiles) * BN
        rn = n0.to(tl.int64) + tl.arange(0, BN)
        nmask = rn < N
        # One weight block row covers the BN (<= 128, dividing 128) columns: one scale a K tile.
        sb_tile = sb_ptr + e.to(tl.int64) * ssbe + (n0 // 128) * ssbn
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        # Scales of K tile kt + 1 are loaded while tile kt's MMA runs (their latency off the
        # FMA's path); the FMA order is unchanged.
        sa = tl.load(sa_ptr + ra * ssam, mask=mmask, other=0.0)  # K >= 128 (the host's check)
        sb = tl.load(sb_tile)
        for kt in range(0, k_tiles):
            a = _a_tile(a_ptr, ra, mmask, r0, kt, sam, sak, K, TMA_A)
            b = _b_tile(b_ptr, e, n0, N, rn, nmask, kt, sbe, sbn, sbk, K, TMA_B)
            kn = tl.minimum(kt + 1, k_tiles - 1)  # the last tile reloads its own (unused)
            sa_next = tl.load(sa_ptr + ra * ssam + kn * ssak, mask=mmask, other=0.0)
            sb_next = tl.load(sb_tile + kn * ssbk)
            p = tile_dot(a, b, lut_a_ptr, lut_b_ptr, NATIVE, TF32, FP8_A, FP8_B)
            acc = scaled_accumulate(acc, p, sa, tl.zeros([BN], dtype=tl.float32) + sb)
            sa, sb = sa_next, sb_next
        tl.store(
            c_ptr + rm[:, None] * scm + rn[None, :] * scn,
            acc.to(c_ptr.dtype.element_ty),
            mask=mmask[:, None] & nmask[None, :],
        )
