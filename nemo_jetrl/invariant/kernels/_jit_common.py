"""The @triton.jit helper the invariant matmul and attention kernels share (imports triton at its
top; only `_jit_matmul` and `_jit_attention` import it, into their globals where Triton finds it).
"""

import triton
import triton.language as tl


@triton.jit
def ordered_dot(a, b, acc):
    # acc + a @ b with fp32 products (exact for bf16/fp16 operands) summed over k by one
    # tl.sum over the middle axis, which the interpreter runs as numpy's sum: k-slice by
    # k-slice, the same order for every output element whatever its row. The kernels use it
    # under Triton's CPU interpreter only: there tl.dot is numpy's BLAS matmul, whose rounding
    # depends on where a row sits in the tile (measured: OpenBLAS, Haswell kernels), which
    # would hide the kernels' own order. On a GPU tl.dot runs (`gpu` tests measure it).
    prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
    return acc + tl.sum(prod, axis=1)
