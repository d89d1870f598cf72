"""Element offsets past 2**31 in the Triton kernels (issue 29, point 2): under the interpreter
on CPU, compiled on a GPU (the tensors then live there: ~4.5 GB and ~9 GB of address space).

WGrad hands the Triton GEMM transposed views: K is the token count and the K stride is the
layer width, so ``k * stride`` passes 2**31 at ~131k tokens of a 16384-wide layer. The
interpreter evaluates index arithmetic in numpy with the kernel's integer types, so an int32
offset wraps here exactly as on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.fp8 import BlockQuantized
from nemo_jetrl.fp8.gemm import blockwise_matmul

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton takes CUDA tensors


def _codes(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Random E4M3 codes of +-1 and +-2 (0x38, 0x40, sign bit 0x80). With `_pow2_scales` every
    tile dot (an integer, |.| <= 512) and every partial sum of the GEMM (|.| <= 1025 * 2**11 <
    2**22 in steps of 2**-2: 24 bits) is exact in fp32, so any accumulation order gives the same
    bits (on a GPU too: Hopper's FP8 MMA keeps ~14 bits while it sums a tile, these need 10)."""
    one = torch.randint(0, 2, (rows, cols), generator=g, dtype=torch.bool)
    mag = torch.where(one, 0x38, 0x40).to(torch.uint8)
    return mag | (torch.randint(0, 2, (rows, cols), generator=g, dtype=torch.uint8) << 7)


def _pow2_scales(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    return 2.0 ** torch.randint(-1, 2, (rows, cols), generator=g).float()


# (row stride, tokens): a 16384-wide layer at 131k tokens (the real case: 1025 K tiles, ~1 min
# per GEMM in the interpreter), and a 2**21 stride that crosses 2**31 after 1024 tokens (fast).
CASES = [
    pytest.param(16384, 131072 + 128, marks=pytest.mark.slow, id="stride16384-131k"),
    pytest.param(2**21, 1024 + 128, id="stride2M-1k"),
]


@pytest.mark.parametrize(("stride", "tokens"), CASES)
def test_triton_gemm_k_offsets_past_2_31_do_not_wrap(stride, tokens):
    from nemo_jetrl.fp8.triton_gemm import block_fp8_gemm_triton

    g = torch.Generator().manual_seed(0)
    # The last K tile starts at element offset 2**31. An int32 offset wraps to -2**31 + ..., so
    # r0 rows sit before the views to keep wrapped addresses inside the allocation (rows 0..127,
    # zeroed). ~4.3 GB of address space; only the elements the views cover are touched.
    r0 = 2**31 // stride
    storage = torch.empty(r0 + tokens, stride, dtype=torch.uint8, device=DEVICE)
    storage[r0:, :256] = _codes(tokens, 256, g).to(DEVICE)
    storage[:128, :256] = 0
    kb = -(-tokens // 128)
    views = [storage[r0:, c : c + 128].t().view(torch.float8_e4m3fn) for c in (0, 128)]
    assert views[0].shape == (128, tokens) and views[0].stride() == (1, stride)
    assert (tokens - 1) * stride >= 2**31
    a, b = (BlockQuantized(v, _pow2_scales(128, kb, g).to(DEVICE), (1, 128), "e4m3", True)
            for v in views)  # fmt: skip
    got = block_fp8_gemm_triton(a, b, out_dtype=torch.float32).cpu()
    # The torch reference GEMM on contiguous CPU copies (no offset past 2**31): every sum is
    # exact (`_codes`), so it gives the kernel's bits, at ~1 s instead of a second ~1 min
    # interpreter GEMM (the kernel on the copies was the reference before, issue 40).
    a_c, b_c = (BlockQuantized(q.data.cpu().contiguous(), q.scale_inv.cpu(), (1, 128), "e4m3", True)
                for q in (a, b))  # fmt: skip
    want = blockwise_matmul(a_c, b_c, out_dtype=torch.float32, exact=True)
    assert torch.isfinite(want).all() and want.abs().max() > 0
    bad = int((got.view(torch.int32) != want.view(torch.int32)).sum())
    assert bad == 0, f"{bad} of {got.numel()} outputs differ: offsets wrapped at 2**31"


@pytest.mark.parametrize("block", [(1, 128), (128, 1)])
def test_quantizer_row_offsets_past_2_31_do_not_wrap(block):
    """The quantizer widens its row/column indices to int64 before any stride multiply."""
    from nemo_jetrl.fp8 import quantize_blockwise
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

    stride, tokens = 2**21, 1024 + 128
    r0 = 2**31 // stride
    storage = torch.empty(r0 + tokens, stride, dtype=torch.bfloat16, device=DEVICE)
    g = torch.Generator().manual_seed(1)
    storage[r0:, :256] = torch.randn(tokens, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    storage[:128, :256] = 0
    x = storage[r0:, :256]
    assert x.stride(0) * (tokens - 1) >= 2**31
    want = quantize_blockwise(x.cpu().contiguous(), block)  # the torch reference, on CPU
    got = quantize_blockwise_triton(x, block)
    got = BlockQuantized(got.data.cpu(), got.scale_inv.cpu(), got.block, got.fmt, True)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale_inv.view(torch.int32), want.scale_inv.view(torch.int32))
