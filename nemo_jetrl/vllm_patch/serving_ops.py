"""The two custom ops our vLLM kernel runs (`kernel.py`), and one serving GEMM with them.

``torch.ops.nemo_jetrl.quantize_act_1x128`` (nemo_jetrl.fp8's 1x128 quantizer, written in the
layout the layer's GEMM reads) and ``torch.ops.nemo_jetrl.fp8_block_gemm`` (the planned GEMM
backend): opaque to vLLM's torch.compile/inductor, so the quantizer is never re-derived. On the
``triton_splitk`` backend one op, ``fp8_split_linear``, does both (`triton_split.split_linear`:
at decode sizes the quantization runs inside the GEMM's launch, with the same codes).
`serving_forward` is what a patched layer runs per call.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_jetrl.fp8 import BlockQuantized, quantize_blockwise
from nemo_jetrl.fp8.gemm_backends import run_gemm
from nemo_jetrl.fp8.gemm_layouts import activation_layout
from nemo_jetrl.fp8.spec import ACTIVATION_BLOCK as ACT_BLOCK
from nemo_jetrl.fp8.spec import WEIGHT_BLOCK

OP_NAMESPACE = "nemo_jetrl"


def _quantize_act_impl(
    x: torch.Tensor, pow2_scales: bool, eps: float, mn_major: bool = False, rows: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 activation quantization: ``quantize_blockwise(x, (1, 128))``, the one quantizer.

    Unlike the default it does not stop on non-finite input (``check_finite=False``): inside a
    serving engine a finiteness check is a host sync per layer (and breaks CUDA graphs), and
    vLLM's own warm-up and profiling runs feed placeholder data. A block with a NaN/inf gets a
    NaN ``scale_inv``, so its token's output row is NaN, as in vLLM's own kernels; the refit
    guard is what keeps non-finite *weights* out.

    ``mn_major`` and ``rows`` (`gemm_layouts.activation_layout` of the layer's GEMM): the Triton
    kernel writes into buffers of ``pad(M, rows)`` rows, ``scale_inv`` as the MN-major view
    (strides ``(1, pad(M, rows))``) DeepGEMM and cuBLASLt read, so the GEMM copies, pads and
    transposes nothing. Rows past M are zero (codes 0, ``scale_inv`` 1, written by the same
    launch) and never returned: the kernel slices the GEMM's output. Same codes and scale values
    as the compact layout. Needs the Triton kernel (CUDA, or its CPU
    interpreter); elsewhere the compact, unpadded layout is returned.
    """
    from nemo_jetrl.fp8 import triton_kernels

    if _padded_layout_applies(x, mn_major, rows):
        data, scale_inv = _act_buffers(x, rows)
        triton_kernels.quantize_blockwise_triton(
            x, ACT_BLOCK, fmt="e4m3", pow2_scales=pow2_scales, eps=eps, check_finite=False,
            out=(data, scale_inv),
        )  # fmt: skip
        return data, scale_inv
    q = quantize_blockwise(
        x, ACT_BLOCK, fmt="e4m3", pow2_scales=pow2_scales, eps=eps, check_finite=False
    )
    return q.data, q.scale_inv


def _padded_layout_applies(x: torch.Tensor, mn_major: bool, rows: int) -> bool:
    """The one rule (real op and its fake) for when the GEMM's layout is written."""
    from nemo_jetrl.fp8 import triton_kernels

    return (mn_major or rows > 1) and x.dim() == 2 and triton_kernels.can_run(x)


def _act_buffers(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``[pad(M, rows), K]`` FP8 data and its MN-major ``[pad(M, rows), kb]`` fp32 scales
    (strides ``(1, pad4(pad(M, rows)))``, the TMA-aligned layout) on ``x``'s device."""
    m, k = x.shape
    mp = -(-m // rows) * rows
    kb, ld = -(-k // ACT_BLOCK[1]), -(-mp // 4) * 4
    data = x.new_empty((mp, k), dtype=torch.float8_e4m3fn)
    return data, x.new_empty((kb, ld), dtype=torch.float32)[:, :mp].t()


def _gemm_impl(
    a: torch.Tensor,
    a_s: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    out_dtype: torch.dtype,
    a_pow2: bool,
    b_pow2: bool,
    backend: str,
) -> torch.Tensor:
    qa = BlockQuantized(a, a_s, ACT_BLOCK, "e4m3", a_pow2)
    qb = BlockQuantized(b, b_s, WEIGHT_BLOCK, "e4m3", b_pow2)
    return run_gemm(backend, qa, qb, out_dtype)


def _split_linear_impl(
    x: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    out_dtype: torch.dtype,
    a_pow2: bool,
    b_pow2: bool,
    eps: float,
) -> torch.Tensor:
    from nemo_jetrl.fp8.triton_split import split_linear

    qb = BlockQuantized(b, b_s, WEIGHT_BLOCK, "e4m3", b_pow2)
    return split_linear(x, qb, pow2_scales=a_pow2, eps=eps, out_dtype=out_dtype)


def _serving_device() -> torch.device:
    """Where this worker's weights live: its current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ensure_ops() -> Any:
    """Define ``torch.ops.nemo_jetrl.{quantize_act_1x128, fp8_block_gemm}`` once per process.

    Defining operators in our own namespace changes nothing of vLLM's; they stay defined (torch
    has no public way to undefine an operator), which is harmless.
    """
    ns = getattr(torch.ops, OP_NAMESPACE)
    try:
        ns.fp8_split_linear.default  # noqa: B018  (lookup raises when undefined)
        return ns
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op(f"{OP_NAMESPACE}::quantize_act_1x128", mutates_args=())
    def quantize_act_1x128(
        x: torch.Tensor, pow2_scales: bool, eps: float, mn_major: bool, rows: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _quantize_act_impl(x, pow2_scales, eps, mn_major, rows)

    @quantize_act_1x128.register_fake
    def _(
        x: torch.Tensor, pow2_scales: bool, eps: float, mn_major: bool, rows: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if _padded_layout_applies(x, mn_major, rows):
            return _act_buffers(x, rows)
        kb = -(-x.shape[-1] // ACT_BLOCK[1])
        data = torch.empty_like(x, dtype=torch.float8_e4m3fn)
        return data, x.new_empty((*x.shape[:-1], kb), dtype=torch.float32)

    # The op's schema is inferred from _gemm_impl's own signature (one list of typed arguments).
    fp8_block_gemm = torch.library.custom_op(
        f"{OP_NAMESPACE}::fp8_block_gemm", _gemm_impl, mutates_args=()
    )

    @fp8_block_gemm.register_fake
    def _(a, a_s, b, b_s, out_dtype, a_pow2, b_pow2, backend):  # type: ignore[no-untyped-def]
        return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)

    fp8_split_linear = torch.library.custom_op(
        f"{OP_NAMESPACE}::fp8_split_linear", _split_linear_impl, mutates_args=()
    )

    @fp8_split_linear.register_fake
    def _(x, b, b_s, out_dtype, a_pow2, b_pow2, eps):  # type: ignore[no-untyped-def]
        return x.new_empty((x.shape[0], b.shape[0]), dtype=out_dtype)

    return ns


def serving_forward(
    ops: Any,
    x2: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    backend: str,
    out_dtype: torch.dtype,
    settings: tuple[bool, bool, float],
    capture: Any = None,
) -> torch.Tensor:
    """One serving GEMM: ``x2`` [M, K] quantized in ``backend``'s layout, times the stored weight,
    the first M rows of the result. ``settings``: (pow2 activation scales, pow2 weight scales,
    eps). ``capture``: the layer's capture deque (tests), which gets the unpadded operands."""
    pow2, w_pow2, eps = settings
    if backend == "triton_splitk" and capture is None:
        return ops.fp8_split_linear(x2, weight, weight_scale_inv, out_dtype, pow2, w_pow2, eps)
    rows, layout = activation_layout(backend, pow2 and w_pow2)
    m = x2.shape[0]
    q, q_s = ops.quantize_act_1x128(x2, pow2, eps, layout == "mn_major", rows)
    if capture is not None and len(capture) < capture.maxlen:
        capture.append((x2.detach().clone(), q[:m].detach().clone(), q_s[:m].detach().clone()))
    out = ops.fp8_block_gemm(q, q_s, weight, weight_scale_inv, out_dtype, pow2, w_pow2, backend)
    return out[:m]  # a view; unconditional, so a compiled graph holds no guard on M
