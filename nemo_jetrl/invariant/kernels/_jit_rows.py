"""The jitted per-row reductions behind `rows` (read its docstring): RMSNorm's ``rstd`` and
log-softmax's ``(max, log sum exp)``.

Imports triton at its top; only `rows._jit()` imports this module. One program per row; the row
is walked in ``BLOCK``-wide chunks from column 0 up, each lane keeping its own fp32 partial
(lane ``j`` adds columns ``j, j + BLOCK, ...`` in that order), and the ``BLOCK`` lanes are summed
by one ``tl.sum`` at the end. ``BLOCK`` is a launch constant (never derived from the number of
rows), so a row's bits depend on its own values and its length only.
"""

import triton
import triton.language as tl

from nemo_jetrl.fp8._triton_common import to_fp32


@triton.jit
def rms_rstd_kernel(
    x_ptr,
    out_ptr,
    H,
    h_float,
    stride_row,
    eps,
    BLOCK: tl.constexpr,
    IN_BF16: tl.constexpr,
):
    # out[row] = 1 / sqrt(sum(x**2) / H + eps), as ops.rms_norm writes it; divisions and the
    # square root correctly rounded (div_rn, sqrt_rn: plain / and sqrt are approximate on GPUs).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, H, BLOCK):
        c = start + cols
        x = to_fp32(tl.load(x_ptr + row * stride_row + c, mask=c < H, other=0), IN_BF16)
        acc += x * x
    # [1]-shaped from here on (keep_dims): no 0-d tensors or scalar-first div_rn to compile
    total = tl.sum(acc, axis=0, keep_dims=True)
    var = tl.math.div_rn(total, tl.zeros_like(total) + h_float)  # float: Triton specializes int 1
    sq = tl.math.sqrt_rn(var + eps)
    rstd = tl.math.div_rn(tl.zeros_like(sq) + 1.0, sq)
    tl.store(out_ptr + row + tl.arange(0, 1), rstd)


@triton.jit
def logsumexp_kernel(
    x_ptr,
    max_ptr,
    log_sum_ptr,
    V,
    stride_row,
    BLOCK: tl.constexpr,
    IN_BF16: tl.constexpr,
):
    # Two passes over the row: its max (order-free), then sum(exp(x - max)) in the fixed lane
    # order above. Stores max and log(sum) separately so the caller forms (x - max) - log(sum)
    # elementwise, the same expression as ops.log_softmax.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    base = x_ptr + row * stride_row
    mx = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        c = start + cols
        x = to_fp32(tl.load(base + c, mask=c < V, other=0), IN_BF16)
        mx = tl.maximum(mx, tl.where(c < V, x, float("-inf")))
    m = tl.max(mx, axis=0, keep_dims=True)  # [1]
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        c = start + cols
        x = to_fp32(tl.load(base + c, mask=c < V, other=0), IN_BF16)
        acc += tl.where(c < V, tl.exp(x - m), 0.0)
    total = tl.sum(acc, axis=0, keep_dims=True)
    one = tl.arange(0, 1)
    tl.store(max_ptr + row + one, m)
    tl.store(log_sum_ptr + row + one, tl.log(total))
