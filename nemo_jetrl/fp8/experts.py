"""Grouped FP8 expert linear (MoE): E linears ``y_e = x_e @ W_e.T`` in one call, TE's blockwise
recipe per expert, bit for bit what `linear.Fp8BlockLinearFunction` gives on each expert alone.

Input. A router picked experts for each token; the caller sorts the routed token copies by
expert, so ``x [M, K]`` holds expert 0's tokens, then expert 1's, ...: rows
``offsets[e]:offsets[e+1]`` (``offsets`` int64 ``[E+1]``, ``offsets[0] = 0``, ``offsets[E] = M``,
empty experts allowed). ``weight [E, N, K]`` stacks the experts' ``[N, K]`` weights; N and K are
multiples of 128. Output ``y [M, N]`` row m is row m's token through its expert.

Why FProp and DGrad need no per-expert quantization. An activation block is 1x128: one token's
128 channels. Its amax, scale and FP8 codes depend on that token alone, so quantizing the whole
sorted ``x`` at once gives the same bits as quantizing each expert's rows separately, in any
order and with any neighbours: sorting tokens or batching experts cannot change them. Output row
m reads only row m's codes and its expert's weight, so it equals the dense layer's output for
that token. DGrad (``dx_e = dy_e @ W_e``) is the same with ``dy`` 1x128 along N and each
expert's weight blocks reused transposed (no requantization, as in the dense layer).

Where the weight's blocks sit. Expert e's 128x128 blocks cover ``weight[e, 128i:128i+128,
128j:128j+128]``: ``scale_inv`` is ``[E, N/128, K/128]``. Because N is a multiple of 128, block
``(e, i, j)`` is block ``(e*N/128 + i, j)`` of the flattened ``[E*N, K]`` matrix, so one
quantization of the flattened stack gives each expert its own bits (`grouped_tensors`).
`quantize_expert_weights` is therefore the trainer's quantizer: a rollout engine loads these
bytes and never requantizes.

Why WGrad's blocks are per expert. ``dW_e = dy_e.T @ x_e`` reduces over expert e's tokens, and
both operands are quantized 128x1: 128 consecutive tokens of one channel share a scale. If the
blocks ran over the whole sorted batch, a block could hold the last tokens of expert e and the
first of expert e+1: expert e's gradient would depend on another expert's tokens (and so on the
routing of the whole batch). Transformer Engine quantizes each expert's input on its own:
``_GroupedLinear.forward`` in ``transformer_engine/pytorch/module/grouped_linear.py`` splits the
input by ``m_splits`` and calls ``tex.split_quantize(inp_view, m_splits, input_quantizers)`` (one
quantizer per GEMM; older releases ``torch.split`` then ``tex.fused_multi_quantize``), and its
backward splits ``grad_output`` the same way before the grouped WGrad GEMM. So here expert e's
blocks start at its first token ``offsets[e]``; its last block may be short (zero-padded for the
amax, as any edge block). WGrad then accumulates expert e's tokens in 128-token tiles aligned to
those blocks, exactly as the dense layer does on ``x_e`` alone.

Where it runs. `experts_reference` is the readable per-expert reference (host offsets, the
reference quantizer and GEMM); it is the default on CPU, where it equals the dense layer bit
for bit under every config (``exact_gemm``, pow2/FP32 scales, hybrid, fp32/bf16 masters).
`triton_grouped` is the GPU path: each operation is one Triton launch whose programs are
(expert, tile) pairs found from ``offsets`` on the device: no per-expert Python loop, no host
read. Its quantizations are the reference's bits; its GEMMs accumulate in TE's per-tile order
(``acc = fma(p * sa, sb, acc)``), which is the reference's ``exact_gemm=True`` order: bit-equal
when each tile's dot ``p`` is exact in fp32, else within `dispatch.GEMM_TOLERANCE`.
``JETRL_FP8_GROUPED_BACKEND`` = ``auto`` | ``triton`` | ``torch`` forces one.

Non-finite input. On CPU a quantization raises at once naming ``{name}.expert{e}.input`` (or
``.weight``, ``.grad_output``). On CUDA nothing is read on the host: each expert's flag is ORed
on the device (`finite_flags.record_each`) and `check_non_finite` names the experts later.
``offsets`` is validated on CPU; on CUDA that would be a host read, so it is the caller's.
"""

from __future__ import annotations

import os
from itertools import pairwise
from types import ModuleType

import torch

from nemo_jetrl.fp8 import finite_flags
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.dispatch import quantize_blockwise
from nemo_jetrl.fp8.formats import Fp8Format
from nemo_jetrl.fp8.grouped_tensors import (
    GroupedQuantizedWeights,
    GroupedTokenBlocks,
    expert_of_rows,
    per_expert_any,
    raise_non_finite_expert,
)
from nemo_jetrl.fp8.linear import check_expert_dims
from nemo_jetrl.fp8.quantize import BlockQuantized
from nemo_jetrl.fp8.spec import BLOCK, WEIGHT_BLOCK
from nemo_jetrl.fp8.staging import quantized_weight_problem

ENV_GROUPED_BACKEND = "JETRL_FP8_GROUPED_BACKEND"
GROUPED_BACKENDS = ("auto", "triton", "torch")


def grouped_backend(x: torch.Tensor) -> str:
    """Which implementation runs for ``x``: ``"triton"`` (CUDA, or forced under the
    interpreter) or ``"torch"`` (the per-expert reference)."""
    from nemo_jetrl.fp8 import triton_kernels

    choice = os.environ.get(ENV_GROUPED_BACKEND, "auto").strip().lower()
    if choice not in GROUPED_BACKENDS:
        raise ValueError(f"{ENV_GROUPED_BACKEND}={choice!r}: use one of {list(GROUPED_BACKENDS)}")
    if choice == "torch":
        return "torch"
    runnable = triton_kernels.can_run(x)
    if choice == "triton":
        if not runnable:
            raise RuntimeError(
                f"{ENV_GROUPED_BACKEND}=triton but Triton cannot run here (needs triton and a "
                "CUDA tensor, or TRITON_INTERPRET=1 for CPU tensors)"
            )
        return "triton"
    return "triton" if runnable and x.is_cuda else "torch"


def _ops(x: torch.Tensor) -> ModuleType:
    if grouped_backend(x) == "triton":
        from nemo_jetrl.fp8 import triton_grouped

        return triton_grouped
    from nemo_jetrl.fp8 import experts_reference

    return experts_reference


def _check_inputs(
    x: torch.Tensor, n: int, k: int, e: int, offsets: torch.Tensor, name: str
) -> None:
    check_expert_dims(k, n, name)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{name}: x must be [M, {k}], got {tuple(x.shape)}")
    if offsets.dtype != torch.int64 or tuple(offsets.shape) != (e + 1,):
        raise ValueError(
            f"{name}: offsets must be int64 [{e + 1}] (E+1 for E={e} experts), got "
            f"{offsets.dtype} {tuple(offsets.shape)}"
        )
    if offsets.device != x.device:
        raise ValueError(f"{name}: offsets on {offsets.device}, x on {x.device}")
    if finite_flags.sync_free(x):
        return  # checking the values would be a host read
    off = offsets.tolist()
    if off[0] != 0 or off[-1] != x.shape[0] or any(b < a for a, b in pairwise(off)):
        raise ValueError(
            f"{name}: offsets {off} must start at 0, end at M={x.shape[0]} and never decrease"
        )


def _quantize_rows(
    ops: ModuleType, t: torch.Tensor, offsets: torch.Tensor, fmt: Fp8Format,
    config: Fp8LinearConfig, name: str, what: str, check: bool = True,
) -> BlockQuantized:  # fmt: skip
    """1x128 per token; non-finite input raises (CPU) or is flagged per expert (CUDA), unless
    ``check`` is False (a serving engine: non-finite values pass through, as in its dense path)."""
    deferred = check and finite_flags.sync_free(t)
    q = ops.quantize_rows(
        t, offsets, fmt=fmt, pow2_scales=config.pow2_scales, eps=config.eps,
        name=name, what=what, check_finite=check and not deferred,
    )  # fmt: skip
    if deferred:
        owner = expert_of_rows(offsets, t.shape[0])
        bad = per_expert_any(torch.isnan(q.scale_inv).any(1), owner, offsets.shape[0] - 1)
        finite_flags.record_each(f"{name}.expert{{}}.{what}", bad)
    return q


def _quantize_tokens(
    ops: ModuleType, t: torch.Tensor, offsets: torch.Tensor, fmt: Fp8Format,
    config: Fp8LinearConfig, name: str, what: str,
) -> GroupedTokenBlocks:  # fmt: skip
    """128x1 per expert (WGrad); non-finite handling as `_quantize_rows`."""
    deferred = finite_flags.sync_free(t)
    q: GroupedTokenBlocks = ops.quantize_tokens(
        t, offsets, fmt=fmt, pow2_scales=config.pow2_scales, eps=config.eps,
        name=name, what=what, check_finite=not deferred,
    )  # fmt: skip
    if deferred:
        cols = torch.arange(q.scale_inv.shape[1], device=t.device)
        owner = torch.searchsorted(q.block_offsets[1:].contiguous(), cols, right=True)
        bad = per_expert_any(torch.isnan(q.scale_inv).any(0), owner, offsets.shape[0] - 1)
        finite_flags.record_each(f"{name}.expert{{}}.{what}", bad)
    return q


def _quantize_experts(
    ops: ModuleType, weight: torch.Tensor, config: Fp8LinearConfig, name: str, *, pair: bool
) -> tuple[GroupedQuantizedWeights, GroupedQuantizedWeights]:
    """(W, W.t()) per expert, 128x128; ``pair`` asks for a contiguous W.t() (DGrad)."""
    deferred = finite_flags.sync_free(weight)
    qw, qwt = ops.quantize_experts(
        weight, fmt=config.forward_format, pow2_scales=config.pow2_scales, eps=config.eps,
        name=name, check_finite=not deferred, pair=pair,
    )  # fmt: skip
    if deferred:
        bad = torch.isnan(qw.scale_inv).flatten(1).any(1)
        finite_flags.record_each(f"{name}.expert{{}}.weight", bad)
    return qw, qwt


def _fprop(
    ops: ModuleType, qx: BlockQuantized, qw: GroupedQuantizedWeights, offsets: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, exact: bool,
) -> torch.Tensor:  # fmt: skip
    """The forward GEMM shared by training and rollout (so both give the same bits)."""
    if bias is None:
        return ops.gemm_rows(qx, qw, offsets, out_dtype=out_dtype, exact=exact)
    out = ops.gemm_rows(qx, qw, offsets, out_dtype=torch.float32, exact=exact)
    rows_bias = bias.float().index_select(0, expert_of_rows(offsets, out.shape[0]))
    return (out + rows_bias).to(out_dtype)  # fp32 epilogue, as the dense layer's


class GroupedFp8LinearFunction(torch.autograd.Function):
    """Autograd of `grouped_fp8_linear` (see the module docstring for the math)."""

    @staticmethod
    def forward(ctx, x, weight, offsets, config: Fp8LinearConfig, name: str):  # type: ignore[override]
        if weight.dim() != 3:
            raise ValueError(f"{name}: weight must be [E, N, K], got {tuple(weight.shape)}")
        n_exp, n, k = weight.shape
        _check_inputs(x, n, k, n_exp, offsets, name)
        ops = _ops(x)
        fwd = config.forward_format
        qx = _quantize_rows(ops, x, offsets, fwd, config, name, "input")
        qw, qwt = _quantize_experts(ops, weight, config, name, pair=ctx.needs_input_grad[0])
        out = _fprop(ops, qx, qw, offsets, None, x.dtype, config.exact_gemm)
        tensors = [qwt.data, qwt.scale_inv, offsets]
        if ctx.needs_input_grad[1]:  # WGrad: x blocked 128x1 per expert, from high precision
            qxc = _quantize_tokens(ops, x, offsets, fwd, config, name, "input")
            tensors += [qxc.data, qxc.scale_inv, qxc.block_offsets, qxc.token_offsets]
        ctx.save_for_backward(*tensors)
        ctx.config, ctx.name, ctx.ops = config, name, ops
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return out

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        config: Fp8LinearConfig = ctx.config
        ops, name, exact = ctx.ops, ctx.name, config.exact_gemm
        saved = ctx.saved_tensors
        fwd, gfmt, pow2 = config.forward_format.name, config.grad_format, config.pow2_scales
        qwt = GroupedQuantizedWeights(saved[0], saved[1], fwd, pow2)
        offsets = saved[2]
        dy2 = dy.to(ctx.x_dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qdy = _quantize_rows(ops, dy2, offsets, gfmt, config, name, "grad_output")
            dx = ops.gemm_rows(qdy, qwt, offsets, out_dtype=ctx.x_dtype, exact=exact)
        if ctx.needs_input_grad[1]:
            qxc = GroupedTokenBlocks(saved[3], saved[4], saved[5], saved[6], fwd, pow2)
            qdyc = _quantize_tokens(ops, dy2, offsets, gfmt, config, name, "grad_output")
            dw = ops.gemm_tokens(qdyc, qxc, offsets, out_dtype=ctx.w_dtype, exact=exact)
        return dx, dw, None, None, None


def grouped_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    config: Fp8LinearConfig,
    name: str,
) -> torch.Tensor:
    """``y[rows_e] = x[rows_e] @ weight[e].T`` in blockwise FP8 for every expert e.

    ``x [M, K]`` sorted by expert, ``weight [E, N, K]`` (fp32 or bf16 master), ``offsets``
    int64 ``[E+1]`` (rows ``offsets[e]:offsets[e+1]`` go to expert e). Differentiable in ``x``
    and ``weight``; per expert bit-identical to `linear.Fp8BlockLinearFunction` on the CPU path.
    """
    return GroupedFp8LinearFunction.apply(x, weight, offsets, config, name)


def quantize_expert_weights(
    weight: torch.Tensor, config: Fp8LinearConfig, name: str = "experts"
) -> GroupedQuantizedWeights:
    """``weight [E, N, K]`` quantized 128x128 per expert with the trainer's quantizer (the bits
    `grouped_fp8_linear` uses), for a rollout engine to load as is. Checked at once on every
    device (a refit must fail naming ``{name}.expert{e}.weight`` before anything is staged)."""
    if weight.dim() != 3:
        raise ValueError(f"{name}: expert weights must be [E, N, K], got {tuple(weight.shape)}")
    n_exp, n, k = weight.shape
    check_expert_dims(k, n, name)
    fmt, pow2 = config.forward_format, config.pow2_scales
    q = quantize_blockwise(
        weight.reshape(n_exp * n, k), WEIGHT_BLOCK, fmt=fmt, pow2_scales=pow2, eps=config.eps,
        name=name, check_finite=False,
    )  # fmt: skip
    if not bool(torch.isfinite(q.scale_inv).all()):
        raise_non_finite_expert(
            weight, None, WEIGHT_BLOCK, f"{name}.expert{{}}.weight",
            fmt=fmt, pow2_scales=pow2, eps=config.eps,
        )  # fmt: skip
    scale = q.scale_inv.reshape(n_exp, n // BLOCK, k // BLOCK)
    return GroupedQuantizedWeights(q.data.reshape(n_exp, n, k), scale, fmt.name, pow2)


def load_expert_weights(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    config: Fp8LinearConfig,
    name: str = "experts",
    dtype: torch.dtype = torch.bfloat16,
) -> GroupedQuantizedWeights:
    """Trainer-quantized expert weights (``data [E, N, K]`` FP8 or its uint8 bits, ``scale_inv
    [E, N/128, K/128]``) checked for a rollout engine, without requantizing: what
    `staging.quantized_weight_problem` refuses for a dense weight (NaN/inf bytes, scales not
    finite and > 0, blocks overflowing ``dtype``) is refused naming ``{name}.expert{e}.weight``."""
    if data.dim() != 3:
        raise ValueError(f"{name}: expert weights must be [E, N, K], got {tuple(data.shape)}")
    n_exp, n, k = data.shape
    check_expert_dims(k, n, name)
    want = config.forward_format.dtype
    data = data.view(want) if data.dtype == torch.uint8 else data
    if data.dtype != want:
        raise TypeError(f"{name}: data must be {want} (or uint8 bits), got {data.dtype}")
    if tuple(scale_inv.shape) != (n_exp, n // BLOCK, k // BLOCK):
        raise ValueError(
            f"{name}: scale_inv shape {tuple(scale_inv.shape)} != "
            f"{(n_exp, n // BLOCK, k // BLOCK)} ([E, N/128, K/128])"
        )
    scale = scale_inv.float()
    flat = (data.reshape(n_exp * n, k), scale.reshape(n_exp * n // BLOCK, k // BLOCK))
    if quantized_weight_problem(*flat, dtype) is not None:  # one check; the loop only names
        for e in range(n_exp):
            problem = quantized_weight_problem(data[e], scale[e], dtype)
            if problem:
                raise ValueError(f"{name}.expert{e}.weight: {problem}; nothing was loaded")
    return GroupedQuantizedWeights(data, scale, config.forward_format.name, config.pow2_scales)


def grouped_fp8_linear_inference(
    x: torch.Tensor,
    qweights: GroupedQuantizedWeights,
    offsets: torch.Tensor,
    config: Fp8LinearConfig,
    name: str,
    bias: torch.Tensor | None = None,
    *,
    check_finite: bool = True,
) -> torch.Tensor:
    """Rollout twin of `grouped_fp8_linear`'s forward on pre-quantized expert weights: the
    same activation quantizer and GEMM, so the same output bits. ``bias`` (optional, ``[E, N]``)
    is added in fp32 to the fp32 GEMM result, as the dense layer's epilogue does.
    ``check_finite=False``: non-finite input is not an error (a serving engine's warm-up runs on
    uninitialised buffers; vLLM's dense path under our kernel lets such values through too)."""
    n_exp, n, k = qweights.data.shape
    _check_inputs(x, n, k, n_exp, offsets, name)
    if qweights.fmt != config.forward_format.name or qweights.pow2_scales != config.pow2_scales:
        raise ValueError(
            f"{name}: weights quantized as {qweights.fmt}/pow2={qweights.pow2_scales}, config "
            f"wants {config.forward_format.name}/pow2={config.pow2_scales}"
        )
    if bias is not None and tuple(bias.shape) != (n_exp, n):
        raise ValueError(f"{name}: bias must be [{n_exp}, {n}], got {tuple(bias.shape)}")
    ops = _ops(x)
    qx = _quantize_rows(ops, x, offsets, config.forward_format, config, name, "input", check_finite)
    return _fprop(ops, qx, qweights, offsets, bias, x.dtype, config.exact_gemm)


__all__ = [
    "GroupedFp8LinearFunction",
    "GroupedQuantizedWeights",
    "grouped_backend",
    "grouped_fp8_linear",
    "grouped_fp8_linear_inference",
    "load_expert_weights",
    "quantize_expert_weights",
]
