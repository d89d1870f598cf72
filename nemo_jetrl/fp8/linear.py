"""The training FP8 linear: TE ``Float8BlockScaling`` emulated in torch (``Fp8BlockLinear``).

A linear layer ``y = x @ W.T + b`` runs three GEMMs. Under TE's blockwise recipe each GEMM takes
FP8 operands with one scale per block, and the block shapes are chosen so every operand is
blocked along its GEMM's reduction dim (see ``gemm.py``)::

    FProp   y  = x  @ W.T   x: 1x128 (per token, along K)   W: 128x128          -> y in x.dtype
    DGrad   dx = dy @ W     dy: 1x128 (per token, along N)  W: the SAME 128x128 blocks,
                                                               transposed (no requantization)
    WGrad   dW = dy.T @ x   dy and x each quantized 128x1 (128 tokens of one channel) from their
                            high-precision values                              -> dW in W.dtype

What is saved for backward is FP8: the weight's 128x128 quantization (for DGrad) and the input's
128x1 quantization, computed in forward from the high-precision input (TE's "columnwise usage");
the high-precision input itself is not kept. Gradients passed between layers stay in the
activation dtype (BF16). The master weight stays in its own dtype (an fp32 master gets fp32
gradients). Under ``hybrid`` the gradient ``dy`` is quantized to E5M2; x and W are always E4M3.

Where the GEMMs run. On CPU every GEMM is the torch reference `gemm.blockwise_matmul`. On CUDA
they go through `dispatch.fp8_gemm`: DeepGEMM, ``scaled_mm`` (cuBLASLt) or our Triton block
GEMM, planned once per GEMM signature by `gemm_backends` (``JETRL_FP8_GEMM_BACKEND`` forces one,
the reference included). Only the GEMM's accumulation differs between
them; the FP8 operands, i.e. the on-policy promise, are the same bits on every backend. FProp
asks the GEMM for fp32 output only when a bias must be added in fp32 (TE's epilogue), else for the
activation dtype directly (one rounding of the fp32 accumulator, as before). On CUDA nothing
reads the host: non-finite input is flagged on the device (`finite_flags`; call
`nemo_jetrl.fp8.check_non_finite()` once per step), and the backward operands come transposed
from the quantizer (W.T written in the same pass as W, x and dy 128x1 written as [K, M]).

Per layer, not per call: the FP8 weight and its transpose are quantized once per weight version
and reused by every forward (micro-batches, activation-checkpoint recomputes) until the weight
changes (`weight_cache`), and the quantizer, GEMM backends and scale layouts are planned once per
input device/dtype (`linear_plan`: the environment knobs are read there). The rollout-side twin
is `inference_linear.Fp8InferenceLinear`.
"""

from __future__ import annotations

import torch
from torch import nn

from nemo_jetrl.fp8 import dispatch, finite_flags
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.dispatch import (
    fp8_gemm,
    quant_backend,
    quantize_blockwise,
    quantize_with_transpose,
)
from nemo_jetrl.fp8.gemm import blockwise_matmul
from nemo_jetrl.fp8.gemm_layouts import gemm_ready_weight_scales
from nemo_jetrl.fp8.linear_plan import LinearPlan, make_plan, plan_key
from nemo_jetrl.fp8.quantize import BlockQuantized
from nemo_jetrl.fp8.rowcol_quantize import quantize_rowcol_reference, quantize_rowcol_triton
from nemo_jetrl.fp8.spec import linear_dims_problem
from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton
from nemo_jetrl.fp8.weight_cache import WeightCache


def _on_gpu(t: torch.Tensor | BlockQuantized) -> bool:
    """Whether ``t`` (a tensor or quantized operand) takes the CUDA path (asked at plan time)."""
    return (t.data if isinstance(t, BlockQuantized) else t).is_cuda


def linear_gemm(
    a: BlockQuantized,
    b: BlockQuantized,
    *,
    out_dtype: torch.dtype,
    exact: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """``a @ b.T`` for the layers' GEMMs: `dispatch.fp8_gemm` on ``backend`` (a planned one;
    None: plan per call on CUDA operands, the reference on CPU ones)."""
    if backend is None:
        if not _on_gpu(a):
            return blockwise_matmul(a, b, out_dtype=out_dtype, exact=exact)
        return fp8_gemm(a, b, out_dtype=out_dtype, exact=exact)
    return fp8_gemm(a, b, out_dtype=out_dtype, exact=exact, backend=backend, planned=True)


def fp8_linear_forward(
    qx: BlockQuantized,
    qw: BlockQuantized,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    exact: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """FProp on quantized operands: fp32 GEMM, bias added in fp32 (GEMM epilogue), cast once.
    ``backend``: the planned GEMM (None: CUDA operands plan per call, CPU ones use the
    reference)."""
    if backend is not None or _on_gpu(qx):
        # Fast kernels write the output dtype from their fp32 accumulator; ask for fp32 only
        # when the bias still has to be added in fp32.
        out_dt = out_dtype if bias is None else torch.float32
        out = linear_gemm(qx, qw, out_dtype=out_dt, exact=exact, backend=backend)
    else:
        out = blockwise_matmul(qx, qw, out_dtype=torch.float32, exact=exact)
    if bias is not None:
        out = out.add_(bias)  # fp32 += bias: the bias upcast inside the add (no fp32 copy of it)
    return out.to(out_dtype)


def check_fp8_dims(in_features: int, out_features: int, label: str) -> None:
    """A linear's dims under TE's FP8 rule (`spec.linear_dims_problem`): partial 128-blocks run
    (ceil-sized scale grids), dims TE would refuse are refused (keep the layer in BF16)."""
    why = linear_dims_problem(in_features, out_features)
    if why is not None:
        raise ValueError(
            f"{label}: {why}; keep this layer in BF16 (convert_to_fp8_training does so "
            "automatically)"
        )


def check_expert_dims(in_features: int, out_features: int, label: str) -> None:
    """Fused experts need both dims to be multiples of 128 (each expert's blocks must start on a
    block edge of the stacked weight); else keep the experts in BF16."""
    mult = Fp8LinearConfig.DIM_MULTIPLE
    if in_features % mult or out_features % mult:
        raise ValueError(
            f"{label}: in_features={in_features}, out_features={out_features} must both be "
            f"multiples of {mult} for FP8 blockwise scaling; keep this layer in BF16 "
            "(convert_to_fp8_training does so automatically)"
        )


class LayerState:
    """What an `Fp8BlockLinear` keeps between calls: its `LinearPlan` and its `WeightCache`."""

    def __init__(self, cache_weight: bool = True) -> None:
        self.cache_weight = cache_weight
        self.plan: LinearPlan | None = None
        self.cache = WeightCache()

    def plan_for(self, x, weight, bias, config: Fp8LinearConfig) -> LinearPlan:  # type: ignore[no-untyped-def]
        """The plan for these inputs: the held one while device, dtypes and config match (one
        tuple compare per call), else a new one (reads the environment, plans the GEMMs)."""
        key = plan_key(x, weight, bias, config)
        plan = self.plan
        if plan is None or plan.key != key:
            self.cache.clear()  # a new config or device: the cached weight may not fit it
            gpu = _on_gpu(x)
            quant = quant_backend(x) if gpu else None
            fused = gpu and dispatch._fast(x, quant)  # asked once here, not per call
            plan = self.plan = make_plan(
                key, config, gpu=gpu, quant=quant, cache_weight=self.cache_weight,
                fused_rowcol=fused,
            )  # fmt: skip
        return plan

    def __deepcopy__(self, memo: dict) -> LayerState:
        return LayerState(self.cache_weight)


class Fp8BlockLinearFunction(torch.autograd.Function):
    """Autograd function of ``Fp8BlockLinear`` (see the module docstring for the three GEMMs).
    ``state``: the layer's `LayerState` (None: plan this call alone, cache nothing). ``grad``:
    grad mode at the call (inside ``forward`` it is always off); False quantizes only what
    FProp reads (a scoring forward). ``keep_pair``: make W.T with W even then (a training-mode
    layer: a reentrant checkpoint's no-grad first pass, whose recompute needs it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, config, name, state=None, grad=True, keep_pair=False):  # type: ignore[override]
        state = state or LayerState(cache_weight=False)
        need_dw = grad and ctx.needs_input_grad[1]
        plan = state.plan_for(x, weight, bias, config)
        k = x.shape[-1]
        x2 = x if x.dim() == 2 else x.reshape(-1, k)  # 2-D: no view op per call
        xname = f"{name}.input"
        fwd = plan.fwd_kw
        if plan.gpu and need_dw:  # FProp's 1x128 and WGrad's 128x1, one read
            qx, qxc = _quantize_rowcol(x2, xname, plan, (plan.x_layout, plan.wgrad_layout), **fwd)
        else:
            qx = _quantize(
                x2, config.ACTIVATION_BLOCK, xname, plan, scale_layout=plan.x_layout, **fwd
            )
        pair = ctx.needs_input_grad[0] and (grad or keep_pair)
        qw, qwt = _weight(weight, config, name, plan, state.cache, pair=pair)
        exact = config.exact_gemm
        out = fp8_linear_forward(qx, qw, bias, x.dtype, exact=exact, backend=plan.fprop)
        tensors = [qwt.data, qwt.scale_inv]
        if need_dw:  # WGrad needs x blocked along tokens, as its [K, M] transpose
            if not plan.gpu:
                qxc = _quantize(
                    x2, config.WGRAD_BLOCK, xname, plan, transpose=True, flag=False, **fwd
                )  # same values as qx: checked there
            tensors += [qxc.data, qxc.scale_inv]
        ctx.save_for_backward(*tensors)
        ctx.config, ctx.name, ctx.plan = config, name, plan
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        config: Fp8LinearConfig = ctx.config
        plan: LinearPlan = ctx.plan
        saved = ctx.saved_tensors
        fwd, pow2 = plan.fwd_kw["fmt"].name, config.pow2_scales
        qwt = BlockQuantized(saved[0], saved[1], config.WEIGHT_BLOCK, fwd, pow2)  # W.T's blocks
        dy2 = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
        if dy2.dtype != ctx.x_dtype:
            dy2 = dy2.to(ctx.x_dtype)
        kw = plan.grad_kw
        name = f"{ctx.name}.grad_output"
        dx = dw = db = None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if plan.gpu and need_dx and need_dw:  # DGrad's 1x128 and WGrad's 128x1, one read
            qdy, qdyct = _quantize_rowcol(
                dy2, name, plan, (plan.dy_layout, plan.wgrad_layout), **kw
            )
        elif need_dx:
            qdy = _quantize(
                dy2, config.ACTIVATION_BLOCK, name, plan, scale_layout=plan.dy_layout, **kw
            )
        if need_dw and not (plan.gpu and need_dx):
            qdyct = _quantize(
                dy2, config.WGRAD_BLOCK, name, plan, transpose=True,
                scale_layout=plan.wgrad_layout, flag=not need_dx, **kw,
            )  # fmt: skip
        if need_dx:
            dx = linear_gemm(
                qdy, qwt, out_dtype=ctx.x_dtype, exact=config.exact_gemm, backend=plan.dgrad
            )
            if dx.shape != ctx.x_shape:
                dx = dx.reshape(ctx.x_shape)
        if need_dw:  # both operands transposed: [N, M] x [K, M], 1x128 blocks
            qxct = BlockQuantized(saved[2], saved[3], config.ACTIVATION_BLOCK, fwd, pow2)
            dw = linear_gemm(
                qdyct, qxct, out_dtype=ctx.w_dtype, exact=config.exact_gemm, backend=plan.wgrad
            )
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None


class Fp8BlockLinear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run in blockwise FP8 as TE's ``Float8BlockScaling`` does.

    Parameters (``weight``, ``bias``) are ordinary high-precision master tensors. The FP8 weight
    (and its transpose for DGrad) is quantized once per weight version and reused by every
    forward until the weight changes (`weight_cache`: any in-place update, ``w.data = ...``,
    a replaced parameter or a device/dtype move; not writes through ``w.data``, see
    `invalidate_weight_caches`); ``cache_weight=False`` quantizes it on every call. The GEMM
    backends, quantizer and scale layouts are planned once per input device/dtype
    (`linear_plan`). ``name`` labels errors (e.g. non-finite input) with the layer's name.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        config: Fp8LinearConfig | None = None,
        name: str = "Fp8BlockLinear",
        cache_weight: bool = True,
    ) -> None:
        check_fp8_dims(in_features, out_features, name)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.config = config or Fp8LinearConfig()
        self.name = name
        self.fp8_state = LayerState(cache_weight)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        config: Fp8LinearConfig | None = None,
        *,
        name: str = "linear",
        cache_weight: bool = True,
    ) -> Fp8BlockLinear:
        """An FP8 layer sharing ``linear``'s parameter objects (optimizer state stays valid)."""
        check_fp8_dims(linear.in_features, linear.out_features, name)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        if linear.bias is None:
            layer.register_parameter("bias", None)
        else:
            layer.bias = linear.bias
        layer.config = config or Fp8LinearConfig()
        layer.name = name
        layer.fp8_state = LayerState(cache_weight)
        layer.train(linear.training)
        return layer

    @property
    def fp8_weight_cache(self) -> WeightCache:
        """The cached FP8 weight (``quantizations`` counts how often it was (re)made)."""
        return self.fp8_state.cache

    def replan(self) -> None:
        """Forget the plan (re-read the environment knobs at the next call) and the FP8 weight."""
        self.fp8_state.plan = None
        self.fp8_state.cache.clear()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self.fp8_state.cache.clear()  # .to()/.cuda()/.half(): the old device's copy goes now
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self.name}: input last dim {x.shape[-1]} != in_features {self.in_features}"
            )
        grad = torch.is_grad_enabled()
        return Fp8BlockLinearFunction.apply(
            x, self.weight, self.bias, self.config, self.name, self.fp8_state, grad, self.training
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, config={self.config}"


def _quantize(  # type: ignore[no-untyped-def]
    t: torch.Tensor, block, name: str, plan: LinearPlan, *, pair=False, flag=True, **kw
):
    """Quantize as ``plan`` says: on the CUDA path without a host sync (the quantizer sets the
    device flag `finite_flags.flag` of ``name`` when ``flag``: an operand whose values another
    quantization already flags passes False), checked at once on CPU. ``pair``:
    ``(q, q.t())`` from `quantize_with_transpose`."""
    kw.update(name=name, check_finite=not plan.gpu, backend=plan.quant)
    if plan.gpu and flag:
        kw["nonfinite_flag"] = finite_flags.flag(name, t.device)
    if pair:
        kw.pop("scale_layout", None)
        return quantize_with_transpose(t, block, **kw)
    return quantize_blockwise(t, block, **kw)


def _quantize_rowcol(t: torch.Tensor, name: str, plan: LinearPlan, layouts, **kw):  # type: ignore[no-untyped-def]
    """The CUDA path's ``(1x128, 128x1 transposed)`` pair of ``t`` from one read (the fused
    Triton kernel; the torch quantizer twice), flagged on the device. One ``scale_layout`` for
    both: MN-major if either GEMM reads it (the others read any strides)."""
    flag = finite_flags.flag(name, t.device)
    layout = "mn_major" if "mn_major" in layouts else "compact"
    opts = {"scale_layout": layout, "nonfinite_flag": flag, "name": name, "check_finite": False}
    if plan.two_pass_rowcol:  # decided at plan time, as the rest (`LayerState.plan_for`)
        row = quantize_blockwise_triton(t, (1, 128), **kw, **opts)
        return row, quantize_blockwise_triton(t, (128, 1), transpose=True, **kw, **opts)
    if plan.fused_rowcol:
        return quantize_rowcol_triton(
            t, scale_layout=layout, nonfinite_flag=flag, name=name, check_finite=False, **kw
        )
    row, col = quantize_rowcol_reference(t, name=name, check_finite=False, **kw)
    finite_flags.note(flag, row.scale_inv)
    return row, col


def _quantize_forward(t, block, config: Fp8LinearConfig, name: str, plan: LinearPlan, **kw):  # type: ignore[no-untyped-def]
    """A forward operand (weight or activation) in the config's forward format and scale rule."""
    return _quantize(t, block, name, plan, **plan.fwd_kw, **kw)


def _weight(w, config, name: str, plan: LinearPlan, cache: WeightCache, *, pair: bool):  # type: ignore[no-untyped-def]
    """``(qw, qwt)``: the cached pair while ``w`` is unchanged, else quantized now (both layouts
    from one pass when DGrad needs ``qwt``; else ``qwt`` is ``qw.t()``, never read). A cached
    copy keeps its scales in the layout its GEMM reads (`gemm_ready_weight_scales`: cuBLASLt's
    padded ``scale_b``, made once per weight version instead of per call). Not while a CUDA
    graph is captured: a replay runs no host code, so it must quantize the live weight."""
    cached = plan.cache_weight and not _capturing(w)
    if cached:
        hit = cache.lookup(w, pair)
        if hit is not None:
            return hit[0], hit[1] if hit[1] is not None else hit[0].t()
    wname = f"{name}.weight"
    if pair:
        qw, qwt = _quantize_forward(w, config.WEIGHT_BLOCK, config, wname, plan, pair=True)
    else:
        qw = _quantize_forward(w, config.WEIGHT_BLOCK, config, wname, plan)
        qwt = None
    if cached:
        qw = _gemm_ready(qw, plan.fprop)
        qwt = None if qwt is None else _gemm_ready(qwt, plan.dgrad)
        cache.store(w, qw, qwt)
    return qw, qwt if qwt is not None else qw.t()


def _capturing(w: torch.Tensor) -> bool:
    return w.is_cuda and torch.cuda.is_current_stream_capturing()


def _gemm_ready(q: BlockQuantized, backend: str | None) -> BlockQuantized:
    if backend is None:
        return q
    scale_inv = gemm_ready_weight_scales(backend, q.scale_inv)
    return BlockQuantized(q.data, scale_inv, q.block, q.fmt, q.pow2_scales)
