"""Batch-invariant math: every op here gives each output element the same bits whatever the
shape of the batch it was computed in (see the package docstring for why that matters).

The rule everything below follows: only *elementwise* IEEE operations (``+ - * /``, ``sqrt``,
``round``, comparisons, integer bit operations) touch floating-point values. Each of those is
correctly rounded, so an output element depends on its own inputs alone, never on vector width,
threading or which kernel torch picked for the tensor's shape. Reductions are fixed binary trees
(`tree_sum`), and ``exp``/``log`` are evaluated from those primitives (`exp`, `log`) because
torch's own transcendental kernels take a SIMD path for most elements and a scalar libm path for a
tensor's tail, and the two can differ in the last bit.

On CUDA tensors `rms_norm`, `log_softmax`, `linear` and `attention` run their reductions in the
Triton kernels of `nemo_jetrl.invariant.kernels` instead (an order fixed per feature dimension,
never per batch or sequence length; the elementwise parts stay here); `dispatch` holds the
choice (``JETRL_INVARIANT_KERNELS`` / `dispatch.set_kernels`: ``auto``, ``torch``, ``triton``).
CPU tensors take the elementwise path unless ``triton`` is chosen under ``TRITON_INTERPRET=1``.

Depends on torch (triton lazily, through the kernels).
"""

from __future__ import annotations

import math

import torch

from nemo_jetrl.invariant.backward import linear_grads
from nemo_jetrl.invariant.dispatch import use_triton
from nemo_jetrl.invariant.kernels import attention as k_attention
from nemo_jetrl.invariant.kernels import matmul as k_matmul
from nemo_jetrl.invariant.kernels import rows as k_rows

_LOG2E = 1.4426950408889634
# ln 2 split so that n * _LN2_HI is exact in fp32 for |n| < 2**15 (Cody-Waite reduction).
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
_EXP_MAX = 88.72283  # above: fp32 overflow
_EXP_MIN = -103.97208  # below: under half the smallest fp32 subnormal, rounds to 0
_SQRT2 = 1.4142135623730951


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """``2.0**k`` in fp32 for integer tensors ``k`` in [-126, 127], built from the exponent bits."""
    return ((k + 127) << 23).to(torch.int32).view(torch.float32)


def _exp_fwd(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    xc = x.clamp(_EXP_MIN, _EXP_MAX)
    n = torch.round(xc * _LOG2E)
    r = (xc - n * _LN2_HI) - n * _LN2_LO  # |r| <= ln2/2 (+ rounding)
    p = torch.full_like(r, 1.0 / 5040.0)  # Taylor series to r**7: truncation < 1e-8 relative
    for c in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = p * r + c
    k = n.to(torch.int32).clamp(-252, 254)
    half = torch.div(k, 2, rounding_mode="floor")  # 2**k as two factors: both stay normal
    y = (p * _pow2(half)) * _pow2(k - half)
    y = torch.where(x > _EXP_MAX, torch.full_like(y, math.inf), y)
    y = torch.where(x < _EXP_MIN, torch.zeros_like(y), y)
    return torch.where(torch.isnan(x), x, y)


def _log_fwd(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    tiny = x < 2.0**-126  # subnormals: scale into the normal range first (exact)
    xs = torch.where(tiny, x * 2.0**23, x)
    bits = xs.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 - torch.where(tiny, 23, 0).to(torch.int32)
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)  # mantissa in [1, 2)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)  # m in [sqrt(1/2), sqrt(2)], exact
    ef = (e + big.to(torch.int32)).float()
    f = (m - 1.0) / (m + 1.0)  # log m = 2 atanh(f), |f| <= 0.1716
    f2 = f * f
    p = torch.full_like(f, 1.0 / 13.0)
    for c in (1.0 / 11.0, 1.0 / 9.0, 1.0 / 7.0, 1.0 / 5.0, 1.0 / 3.0, 1.0):
        p = p * f2 + c
    y = ef * _LN2_HI + (ef * _LN2_LO + (f + f) * p)
    y = torch.where(x == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(x == math.inf, torch.full_like(y, math.inf), y)
    return torch.where(torch.isnan(x) | (x < 0), torch.full_like(y, math.nan), y)


class _Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        y = _exp_fwd(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return g * y


class _Log(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return _log_fwd(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return g / x.float()


def exp(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``e**x`` within 2 ulp (normal range), from elementwise ops only; differentiable.
    Results below the fp32 normal range are subnormal or 0 exactly as the product rounds."""
    return _Exp.apply(x)


def log(x: torch.Tensor) -> torch.Tensor:
    """fp32 natural log within 2 ulp, from elementwise ops only; differentiable."""
    return _Log.apply(x)


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum along ``dim`` as a fixed binary tree: pad to a power of two with zeros, then add the
    upper half onto the lower half until one element is left.

    The result does not change when zeros are appended along ``dim`` (the extra levels add
    +0 to each partial sum), so a decode step that sees ``t`` keys and a training row that sees
    all ``T`` keys with the last ``T - t`` masked to 0 produce the same bits. Signed zeros are
    normalised first (``x + 0.0``) so a sum of zeros is +0 on both sides.
    """
    dim = dim % x.dim()
    x = x + 0.0
    n = x.shape[dim]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad_shape = list(x.shape)
        pad_shape[dim] = width - n
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    while width > 1:
        width //= 2
        x = x.narrow(dim, 0, width) + x.narrow(dim, width, width)
    return x if keepdim else x.squeeze(dim)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """fp32 softmax along ``dim``; entries at -inf (or any value under max - 103) get exactly 0,
    so masked positions and absent positions are the same to `tree_sum`."""
    x = x.float()
    e = exp(x - x.amax(dim=dim, keepdim=True))
    return e / tree_sum(e, dim=dim, keepdim=True)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """fp32 ``log_softmax`` along ``dim`` from `exp`, `tree_sum` and `log` (Triton kernel:
    ``(x - max) - log_sum`` with the row's max and log-sum-exp from `kernels.rows`)."""
    x = x.float()
    if use_triton(x, "log_softmax"):
        xt = x.movedim(dim, -1)
        mx, log_sum = k_rows.LogSumExp.apply(xt)
        return ((xt - mx) - log_sum).movedim(-1, dim)
    shifted = x - x.amax(dim=dim, keepdim=True)
    return shifted - log(tree_sum(exp(shifted), dim=dim, keepdim=True))


def token_log_softmax(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log_softmax(x)`` over the last dim gathered at ``ids`` (``x.shape[:-1]``), fp32: the same
    bits as gathering from `log_softmax`'s output. The Triton path forms only the chosen entries
    from the row's max and log-sum-exp (no ``[rows, V]`` output)."""
    x = x.float()
    idx = ids.unsqueeze(-1)
    if use_triton(x, "log_softmax"):
        mx, log_sum = k_rows.LogSumExp.apply(x)
        return ((x.gather(-1, idx) - mx) - log_sum).squeeze(-1)
    return log_softmax(x).gather(-1, idx).squeeze(-1)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` computed as ``x / (1 + e**-x)`` in fp32, returned in ``x.dtype``."""
    xf = x.float()
    return (xf / (1.0 + exp(-xf))).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama/Qwen write it (fp32 statistics, scale applied in the input dtype); the
    Triton kernel (`kernels.rows`) computes the same ``rstd``, the rest is the same expression."""
    xf = x.float()
    if use_triton(x, "rms_norm"):
        rstd = k_rows.RmsRstd.apply(x, eps)
    else:
        var = tree_sum(xf * xf, dim=-1, keepdim=True) / xf.shape[-1]
        rstd = 1.0 / torch.sqrt(var + eps)
    return weight * (xf * rstd).to(x.dtype)


# Chunk rows so a broadcast product holds at most this many fp32 elements (64 MiB).
_MAX_PRODUCT_ELEMENTS = 1 << 24


def _linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).float()
    w = weight.float()
    step = max(1, _MAX_PRODUCT_ELEMENTS // max(1, w.numel()))
    outs = [
        tree_sum(rows[i : i + step, None, :] * w[None], dim=-1)
        for i in range(0, rows.shape[0], step)
    ]
    out = torch.cat(outs, dim=0) if outs else rows.new_zeros(0, w.shape[0])
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*lead, w.shape[0])


class _Linear(torch.autograd.Function):
    """Invariant forward; the backward is `linear_grads`."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear_fwd(x, weight, bias)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return linear_grads(ctx, g)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with fp32 products (exact for BF16 operands) summed by
    `tree_sum`; result in ``x.dtype``. Memory ~ rows * N * K: for narrow layers (``lm_head`` of a
    small vocabulary), not for a model's big GEMMs. The Triton kernel (`kernels.matmul`: fixed
    tiles and K order, fp32 accumulation) has no such limit."""
    if use_triton(x, "linear"):
        out = k_matmul.Matmul.apply(x, weight)
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)
    return _Linear.apply(x, weight, bias)


def _attention_fwd(q, k, v, mask, scaling):
    qf, kf, vf = q.float(), k.float(), v.float()
    scores = tree_sum(qf[:, :, :, None, :] * kf[:, :, None, :, :], dim=-1) * scaling
    if mask is not None:
        scores = scores + mask.float()
    probs = softmax(scores, dim=-1).to(q.dtype)
    out = tree_sum(probs.float()[..., None] * vf[:, :, None, :, :], dim=-2)
    return out.to(q.dtype), probs


class _Attention(torch.autograd.Function):
    """Invariant forward; standard attention backward with torch's GEMMs (the rounding of the
    probabilities to the query dtype is passed straight through, as eager attention does)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scaling):  # type: ignore[override]
        out, probs = _attention_fwd(q, k, v, mask, scaling)
        ctx.save_for_backward(q, k, v, probs)
        ctx.scaling = scaling
        ctx.mark_non_differentiable(probs)
        return out, probs

    @staticmethod
    def backward(ctx, dout, _dprobs):  # type: ignore[override]
        q, k, v, probs = ctx.saved_tensors
        p, do = probs.float(), dout.float()
        dv = p.transpose(-1, -2) @ do
        dp = do @ v.float().transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * ctx.scaling
        dq, dk = ds @ k.float(), ds.transpose(-1, -2) @ q.float()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled dot-product attention for ``query`` ``[B, H, Tq, D]`` and ``key``/``value``
    ``[B, H, Tk, D]`` (already repeated for grouped KV heads); ``mask`` is additive (0 or a
    large negative), broadcastable to ``[B, H, Tq, Tk]``.

    Scores are fp32 dot products over ``D`` (`tree_sum`), scaled, masked, `softmax`-ed; the
    probabilities are rounded to the query dtype (as eager attention does) and the output is a
    `tree_sum` over keys. Returns ``(out [B, Tq, H, D] in query dtype, probs [B, H, Tq, Tk])``.
    The Triton kernel (`kernels.attention`: online softmax over fixed key chunks, the same bits
    for a query in a decode step and in a prefill) returns ``probs`` None, as fused attention does.
    """
    if use_triton(query, "attention"):
        out = k_attention.Attention.apply(query, key, value, mask, scaling).to(query.dtype)
        return out.transpose(1, 2).contiguous(), None
    out, probs = _Attention.apply(query, key, value, mask, scaling)
    return out.transpose(1, 2).contiguous(), probs
