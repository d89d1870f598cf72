"""What each FP8 GEMM backend reads: the rows it takes activations in, the scale layouts it
reads with no copy, and the GEMM shapes it refuses (cuBLASLt, DeepGEMM; Triton takes any).

One home for these rules: the trainer's linear (`linear.py`) and the vLLM serving kernel
(`nemo_jetrl.vllm_patch`) store their operands in these layouts, and `gemm_backends.run_gemm`
pads rows or moves a GEMM to Triton by them, so a token's row gets the same bits on both RL sides.
Converting our compact layout to TE's, vLLM's or DeepGEMM's storage is `layouts`' job.
"""

from __future__ import annotations

import torch


def row_multiple(backend: str) -> int:
    """Rows ``backend`` takes activations in multiples of (cuBLASLt: 4, see `shape_problem`)."""
    return 4 if backend == "scaled_mm" else 1


# cuBLASLt, FP32 scales, K >= 12288: a token's row at M <= 16 != its row among 8192 (pow2, M >= 32: =)
FP32_SCALE_ROW_MULTIPLE = 32


def activation_layout(backend: str, pow2_scales: bool = True) -> tuple[int, str]:
    """(row multiple, ``scale_inv`` layout) of the 1x128 activations ``backend`` reads with no
    copy: MN-major ``[M, kb]`` scales (DeepGEMM's TMA-aligned layout; cuBLASLt's; Triton reads
    strides) on a GPU, compact for the reference. The vLLM kernel's quantizer writes this."""
    fp32 = backend == "scaled_mm" and not pow2_scales
    rows = FP32_SCALE_ROW_MULTIPLE if fp32 else row_multiple(backend)
    return rows, ("compact" if backend == "reference" else "mn_major")


def gemm_ready_weight_scales(backend: str, scale_inv: torch.Tensor) -> torch.Tensor:
    """A 128x128 weight's ``[N/128, kb]`` ``scale_inv`` as ``backend`` reads it, stored at load:
    for ``scaled_mm`` a view ``[:, :kb]`` of a zero-padded ``[N/128, pad4(kb)]`` array whose
    transpose is cuBLASLt's ``scale_b`` (no per-call pad); compact elsewhere (Triton reads
    strides). Same values; in-place writes (a refit) land where the GEMM reads. Idempotent."""
    if backend != "scaled_mm":
        return scale_inv.contiguous()
    if padded_storage(scale_inv) is not None:
        return scale_inv
    nb, kb = scale_inv.shape
    storage = scale_inv.new_zeros(nb, -(-kb // 4) * 4)
    storage[:, :kb] = scale_inv
    return storage[:, :kb]


def padded_storage(s: torch.Tensor) -> torch.Tensor | None:
    """``s``'s storage as cuBLASLt's ``scale_b`` ``[pad4(kb), N/128]`` (strides ``(1, pad4(kb))``),
    or None where ``s`` is not stored so (strides ``(pad4(kb), 1)``, storage covering the pad)."""
    nb, kb = s.shape
    kb4 = -(-kb // 4) * 4
    if s.stride() != (kb4, 1):
        return None
    if s.storage_offset() + nb * kb4 > s.untyped_storage().nbytes() // s.element_size():
        return None
    return s.as_strided((kb4, nb), (1, kb4))


def shape_problem(backend: str, m: int, n: int, k: int) -> str | None:
    """Why ``backend`` cannot take an ``[M, K] x [N, K]`` GEMM of this shape (None: it can).
    Measured on an H100 (torch 2.11, CUDA 13.0; benchmarks/gpu/probe_scaled_mm.py): blockwise
    ``F.scaled_mm`` refuses K or N not a multiple of 16, and cuBLASLt answers NOT_SUPPORTED for
    M not a multiple of 4 (its M-major 1x128 scales). DeepGEMM: vLLM 0.33's own rule
    (``should_use_deepgemm_for_fp8_linear``: N % 64, K % 128; e.g. a 576-wide DGrad is not)."""
    if backend == "scaled_mm" and (m % row_multiple(backend) or n % 16 or k % 16):
        return (
            f"cuBLASLt blockwise FP8 needs M % 4, N % 16 and K % 16 == 0 (got M={m}, N={n}, K={k})"
        )
    if backend == "deep_gemm" and (n % 64 or k % 128):
        return f"DeepGEMM needs N % 64 and K % 128 == 0 (got N={n}, K={k})"
    return None


def mn_major(s: torch.Tensor) -> torch.Tensor:
    """``[R, kb]`` scales with strides ``(1, R)`` (cuBLASLt's 1x128 scale layout)."""
    return s if s.stride() == (1, s.shape[0]) else s.t().contiguous().t()
