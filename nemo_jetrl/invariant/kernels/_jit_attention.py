"""The jitted attention behind `attention` (read its docstring).

Imports triton at its top; only `attention._jit()` imports this module. One program per
(``BM`` queries, batch x head). Keys are walked in ``BN``-wide chunks from key 0 up, the same
chunks for a query whether it is one decode step (keys ``0..t``) or a row of a prefill (keys
``0..T-1``, those after it masked): a chunk with no visible key leaves the running max, sum and
output unchanged (its probabilities are exactly 0 and the rescale factor exactly 1), so the
extra chunks a prefill row walks change no bit. The query and key counts and the mask strides
they set are not specialised (`BATCH_ARGS`): a decode step (``Tq == 1``, keys ``t + 1``) and a
prefill run the same compiled kernel, whatever the counts' divisibility (the mask then loads
without vectors, as it did whenever ``Tk % 16 != 0``).
"""

import triton
import triton.language as tl

from nemo_jetrl.invariant.kernels._jit_common import ordered_dot

BATCH_ARGS = ("Tq", "Tk", "smb", "smq")  # what the batch changes: one compiled kernel for all


@triton.jit(do_not_specialize=BATCH_ARGS)
def attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    o_ptr,
    H,
    Tq,
    Tk,
    D,
    scale,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    smb,
    smh,
    smq,
    smk,
    sob,
    soh,
    sot,
    HAS_MASK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
    ORDERED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    rq = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    rn = tl.arange(0, BN)
    q_ok = rq < Tq
    q = tl.load(
        q_ptr + b * sqb + h * sqh + rq[:, None] * sqt + rd[None, :],
        mask=q_ok[:, None] & (rd[None, :] < D),
        other=0.0,
    )
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for k0 in range(0, Tk, BN):
        rk = k0 + rn
        k_ok = rk < Tk
        kt = tl.load(
            k_ptr + b * skb + h * skh + rk[None, :] * skt + rd[:, None],
            mask=k_ok[None, :] & (rd[:, None] < D),
            other=0.0,
        )
        s = tl.zeros([BM, BN], dtype=tl.float32)
        if ORDERED:  # the CPU interpreter (read `ordered_dot`)
            s = ordered_dot(q, kt, s)
        elif IEEE:
            s = tl.dot(q, kt, s, input_precision="ieee")
        else:
            s = tl.dot(q, kt, s)
        s = s * scale
        if HAS_MASK:
            s += tl.load(
                mask_ptr + b * smb + h * smh + rq[:, None] * smq + rk[None, :] * smk,
                mask=q_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
        s = tl.where(k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row with no visible key so far keeps m = -inf: subtract 0 instead (no inf - inf)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vv = tl.load(
            v_ptr + b * svb + h * svh + rk[:, None] * svt + rd[None, :],
            mask=k_ok[:, None] & (rd[None, :] < D),
            other=0.0,
        )
        # probabilities rounded to the value dtype before the product, as eager attention does
        pv = p.to(vv.dtype)
        acc = acc * alpha[:, None]
        if ORDERED:
            acc = ordered_dot(pv, vv, acc)
        elif IEEE:
            acc = tl.dot(pv, vv, acc, input_precision="ieee")
        else:
            acc = tl.dot(pv, vv, acc)
        m_i = m_new
    # + 0.0: an all-zero output is +0 whether or not masked chunks added (+-0) products
    out = tl.math.div_rn(acc, l_i[:, None] + tl.zeros([BM, BD], dtype=tl.float32)) + 0.0
    tl.store(
        o_ptr + b * sob + h * soh + rq[:, None] * sot + rd[None, :],
        out,
        mask=q_ok[:, None] & (rd[None, :] < D),
    )
