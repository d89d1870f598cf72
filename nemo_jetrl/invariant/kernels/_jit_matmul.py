"""The jitted ``x @ w.T`` behind `matmul` (read its docstring).

Imports triton at its top; only `matmul._jit()` imports this module. One program per
``BM x BN`` output tile; K is walked in ``BK`` steps from 0 up, each step's ``tl.dot`` adding
into one fp32 accumulator (no split-K, no autotune): a row's bits depend on its own values, ``W``
and the launch constants only. ``M`` is not specialised (`BATCH_ARGS`): one decode token and a
prefill of 512 run the same compiled kernel, not an ``M == 1`` or ``M % 16 == 0`` variant.
"""

import triton
import triton.language as tl

from nemo_jetrl.invariant.kernels._jit_common import ordered_dot

BATCH_ARGS = ("M",)  # what the batch changes: one compiled kernel for every value


@triton.jit(do_not_specialize=BATCH_ARGS)
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    sam,
    sak,
    sbn,
    sbk,
    scm,
    scn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
    ORDERED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK).to(tl.int64)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + rk
        a = tl.load(
            a_ptr + rm[:, None] * sam + k[None, :] * sak,
            mask=(rm[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + k[:, None] * sbk + rn[None, :] * sbn,
            mask=(k[:, None] < K) & (rn[None, :] < N),
            other=0.0,
        )
        if ORDERED:  # the CPU interpreter (read `ordered_dot`)
            acc = ordered_dot(a, b, acc)
        elif IEEE:  # fp32 operands: full fp32 products (tl.dot would use TF32 by default)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:  # bf16 / fp16 operands: exact products, fp32 accumulation
            acc = tl.dot(a, b, acc)
    tl.store(
        c_ptr + rm[:, None] * scm + rn[None, :] * scn,
        acc,
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )
