"""FP8 linear layers: TE ``Float8BlockScaling`` emulated in torch, and the rollout-side twin.

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

The rollout side (``Fp8InferenceLinear``) quantizes the weight once per refit and activations
1x128 per call, then runs the same forward function as training: with the same quantizer this is
bit-identical to ``Fp8BlockLinear``'s forward, which is the on-policy promise at layer level.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from nemo_jetrl.fp8 import finite_flags
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.dispatch import fp8_gemm, quantize_blockwise, quantize_with_transpose
from nemo_jetrl.fp8.gemm import blockwise_matmul
from nemo_jetrl.fp8.quantize import BlockQuantized
from nemo_jetrl.fp8.staging import StagedWeight, quantized_weight_problem
from nemo_jetrl.fp8.vllm_native import per_block_cast_native, quantize_group_native

Quantizer = Literal["jetrl", "vllm_native"]
QUANTIZERS: tuple[str, ...] = ("jetrl", "vllm_native")


def _on_gpu(a: BlockQuantized) -> bool:
    """Whether a GEMM on ``a`` goes through the backend dispatch (CUDA operands)."""
    return a.data.is_cuda


def linear_gemm(
    a: BlockQuantized, b: BlockQuantized, *, out_dtype: torch.dtype, exact: bool = False
) -> torch.Tensor:
    """``a @ b.T`` for the layers' GEMMs: `dispatch.fp8_gemm` on CUDA, the reference on CPU."""
    if _on_gpu(a):
        return fp8_gemm(a, b, out_dtype=out_dtype, exact=exact)
    return blockwise_matmul(a, b, out_dtype=out_dtype, exact=exact)


def fp8_linear_forward(
    qx: BlockQuantized,
    qw: BlockQuantized,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    exact: bool = False,
) -> torch.Tensor:
    """FProp on quantized operands: fp32 GEMM, bias added in fp32 (GEMM epilogue), cast once."""
    if _on_gpu(qx):
        # Fast kernels write the output dtype from their fp32 accumulator; ask for fp32 only
        # when the bias still has to be added in fp32.
        out = linear_gemm(
            qx, qw, out_dtype=out_dtype if bias is None else torch.float32, exact=exact
        )
    else:
        out = blockwise_matmul(qx, qw, out_dtype=torch.float32, exact=exact)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def check_fp8_dims(in_features: int, out_features: int, label: str) -> None:
    """FP8 layers need both dims to be multiples of 128 (else keep the layer in BF16)."""
    mult = Fp8LinearConfig.DIM_MULTIPLE
    if in_features % mult or out_features % mult:
        raise ValueError(
            f"{label}: in_features={in_features}, out_features={out_features} must both be "
            f"multiples of {mult} for FP8 blockwise scaling; keep this layer in BF16 "
            "(convert_to_fp8_training does so automatically)"
        )


class Fp8BlockLinearFunction(torch.autograd.Function):
    """Autograd function of ``Fp8BlockLinear`` (see the module docstring for the three GEMMs)."""

    @staticmethod
    def forward(ctx, x, weight, bias, config: Fp8LinearConfig, name: str):  # type: ignore[override]
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        qx = _quantize_forward(x2, config.ACTIVATION_BLOCK, config, f"{name}.input")
        if ctx.needs_input_grad[0]:  # DGrad reads W.T: both layouts from one quantizer pass
            qw, qwt = _quantize_forward(
                weight, config.WEIGHT_BLOCK, config, f"{name}.weight", pair=True
            )
        else:
            qw = _quantize_forward(weight, config.WEIGHT_BLOCK, config, f"{name}.weight")
            qwt = qw.t()  # never read
        out = fp8_linear_forward(qx, qw, bias, x.dtype, exact=config.exact_gemm)
        tensors = [qwt.data, qwt.scale_inv]
        if ctx.needs_input_grad[1]:  # WGrad needs x blocked along tokens, as its [K, M] transpose
            qxc = _quantize_forward(x2, config.WGRAD_BLOCK, config, f"{name}.input", transpose=True)
            tensors += [qxc.data, qxc.scale_inv]
        ctx.save_for_backward(*tensors)
        ctx.config, ctx.name = config, name
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        config: Fp8LinearConfig = ctx.config
        saved = ctx.saved_tensors
        fwd, pow2 = config.forward_format.name, config.pow2_scales
        qwt = BlockQuantized(saved[0], saved[1], config.WEIGHT_BLOCK, fwd, pow2)  # W.T's blocks
        dy2 = dy.reshape(-1, dy.shape[-1]).to(ctx.x_dtype)
        kw = {"fmt": config.grad_format, "pow2_scales": pow2, "eps": config.eps}
        name = f"{ctx.name}.grad_output"
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            qdy = _quantize(dy2, config.ACTIVATION_BLOCK, name, **kw)
            dx = linear_gemm(qdy, qwt, out_dtype=ctx.x_dtype, exact=config.exact_gemm)
            dx = dx.reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # both operands transposed: [N, M] x [K, M], 1x128 blocks
            qxct = BlockQuantized(saved[2], saved[3], config.ACTIVATION_BLOCK, fwd, pow2)
            qdyct = _quantize(dy2, config.WGRAD_BLOCK, name, transpose=True, **kw)
            dw = linear_gemm(qdyct, qxct, out_dtype=ctx.w_dtype, exact=config.exact_gemm)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.float().sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None


class Fp8BlockLinear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run in blockwise FP8 as TE's ``Float8BlockScaling`` does.

    Parameters (``weight``, ``bias``) are ordinary high-precision master tensors; FP8 copies are
    made per call. ``name`` labels errors (e.g. non-finite input) with the layer's name.
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
    ) -> None:
        check_fp8_dims(in_features, out_features, name)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.config = config or Fp8LinearConfig()
        self.name = name

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, config: Fp8LinearConfig | None = None, *, name: str = "linear"
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
        layer.train(linear.training)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self.name}: input last dim {x.shape[-1]} != in_features {self.in_features}"
            )
        return Fp8BlockLinearFunction.apply(x, self.weight, self.bias, self.config, self.name)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, config={self.config}"


def _quantize(t: torch.Tensor, block: tuple[int, int], name: str, *, pair: bool = False, **kw):  # type: ignore[no-untyped-def]
    """Quantize without a host sync on CUDA (`finite_flags`); checked at once on CPU.
    ``pair``: ``(q, q.t())`` from `quantize_with_transpose`."""
    deferred = finite_flags.sync_free(t)
    kw.update(name=name, check_finite=not deferred)
    out = quantize_with_transpose(t, block, **kw) if pair else quantize_blockwise(t, block, **kw)
    if deferred:
        finite_flags.record(name, (out[0] if pair else out).scale_inv)
    return out


def _quantize_forward(t, block, config: Fp8LinearConfig, name: str, **kw):  # type: ignore[no-untyped-def]
    """A forward operand (weight or activation) in the config's forward format and scale rule."""
    fmt, pow2 = config.forward_format, config.pow2_scales
    return _quantize(t, block, name, fmt=fmt, pow2_scales=pow2, eps=config.eps, **kw)


def _quantize_weight(
    w: torch.Tensor, config: Fp8LinearConfig, quantizer: str, name: str
) -> BlockQuantized:
    if quantizer == "vllm_native":
        return per_block_cast_native(w, ue8m0=config.pow2_scales, name=name)
    # checked at once even on CUDA: a refit with NaN must fail naming the weight, before staging
    fmt, pow2 = config.forward_format, config.pow2_scales
    return quantize_blockwise(
        w, config.WEIGHT_BLOCK, fmt=fmt, pow2_scales=pow2, eps=config.eps, name=name
    )


def _quantize_activation(
    x2: torch.Tensor, config: Fp8LinearConfig, quantizer: str, name: str
) -> BlockQuantized:
    if quantizer == "vllm_native":
        return quantize_group_native(x2, ue8m0=config.pow2_scales, name=name)
    return _quantize_forward(x2, config.ACTIVATION_BLOCK, config, name)


class Fp8InferenceLinear(nn.Module):
    """Rollout-side FP8 linear: weight quantized once per refit, activations 1x128 per call.

    ``quantizer="jetrl"`` uses ``nemo_jetrl.fp8`` (what a patched vLLM does: on-policy with
    ``Fp8BlockLinear``); ``"vllm_native"`` emulates an unpatched vLLM 0.32 (``vllm_native.py``),
    for the off-policy baselines. Buffers ``weight_fp8`` (float8 ``[N, K]``) and
    ``weight_scale_inv`` (fp32 ``[ceil(N/128), ceil(K/128)]``) hold the loaded weight.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        config: Fp8LinearConfig | None = None,
        quantizer: Quantizer = "jetrl",
        bias_dtype: torch.dtype = torch.bfloat16,
        name: str = "Fp8InferenceLinear",
    ) -> None:
        super().__init__()
        check_fp8_dims(in_features, out_features, name)
        if quantizer not in QUANTIZERS:
            raise ValueError(f"{name}: quantizer={quantizer!r}: use one of {list(QUANTIZERS)}")
        self.in_features, self.out_features = in_features, out_features
        self.config = config or Fp8LinearConfig()
        if quantizer == "vllm_native" and self.config.forward_format.name != "e4m3":
            raise ValueError(f"{name}: vLLM's native quantizers are E4M3 only")
        self.quantizer = quantizer
        self.name = name
        nb, kb = -(-out_features // 128), -(-in_features // 128)
        fp8 = self.config.forward_format.dtype
        self.register_buffer("weight_fp8", torch.zeros(out_features, in_features, dtype=fp8))
        self.register_buffer("weight_scale_inv", torch.ones(nb, kb, dtype=torch.float32))
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype) if bias else None)
        # The model dtype: dequantized weights must be finite in it (checked on every load).
        self.compute_dtype = bias_dtype
        self.loaded = False

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        config: Fp8LinearConfig | None = None,
        *,
        quantizer: Quantizer = "jetrl",
        name: str = "linear",
    ) -> Fp8InferenceLinear:
        """A rollout layer holding ``linear``'s weight quantized now (and a copy of its bias)."""
        has_bias = linear.bias is not None
        bias_dtype = linear.bias.dtype if has_bias else linear.weight.dtype
        layer = cls(
            linear.in_features, linear.out_features, has_bias,
            config=config, quantizer=quantizer, bias_dtype=bias_dtype, name=name,
        )  # fmt: skip
        layer.load_weight(linear.weight.detach(), None if not has_bias else linear.bias.detach())
        return layer

    @property
    def weight_quantized(self) -> BlockQuantized:
        fmt = self.config.forward_format.name
        return BlockQuantized(
            self.weight_fp8, self.weight_scale_inv, (128, 128), fmt, self.config.pow2_scales
        )

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Quantize a high-precision weight ``[N, K]`` (128x128, the config's scale mode).

        All-or-nothing: weight and bias are checked before either is stored."""
        self._check_shape(weight, "weight")
        q = _quantize_weight(weight, self.config, self.quantizer, f"{self.name}.weight")
        self.commit(self.stage_quantized(q.data, q.scale_inv, bias))

    @torch.no_grad()
    def load_quantized(
        self, data: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        """Load a weight the trainer already quantized (no requantization: same bits).

        All-or-nothing: everything is checked (`stage_quantized`) before anything is stored."""
        self.commit(self.stage_quantized(data, scale_inv, bias))

    @torch.no_grad()
    def stage_quantized(
        self, data: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None
    ) -> StagedWeight:
        """Check a quantized weight (and bias) for this layer without storing anything.

        Refused (ValueError/TypeError naming the layer): wrong shapes or dtypes, FP8 bytes that
        encode NaN/inf (E4M3FN 0x7f/0xff), scales that are not finite and > 0, blocks whose
        dequantized values overflow fp32 (a BF16/FP16-max weight with power-of-two scales), a
        bias for a layer without one, or a non-finite bias. `commit` stores what passed."""
        self._check_shape(data, "data")
        want = self.weight_fp8.dtype
        if data.dtype == torch.uint8:
            data = data.view(want)
        if data.dtype != want:
            raise TypeError(f"{self.name}: data must be {want} (or uint8 bits), got {data.dtype}")
        if tuple(scale_inv.shape) != tuple(self.weight_scale_inv.shape):
            raise ValueError(
                f"{self.name}: scale_inv shape {tuple(scale_inv.shape)} != expected "
                f"{tuple(self.weight_scale_inv.shape)} ([ceil(N/128), ceil(K/128)])"
            )
        problem = quantized_weight_problem(data, scale_inv, self.compute_dtype)
        if problem:
            raise ValueError(f"{self.name}.weight: {problem}; nothing was loaded")
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"{self.name}: layer was built without bias but one was given")
            if tuple(bias.shape) != (self.out_features,) or not bias.is_floating_point():
                raise ValueError(
                    f"{self.name}.bias: {bias.dtype} {tuple(bias.shape)}, expected a float "
                    f"({self.out_features},); nothing was loaded"
                )
            bias = bias.to(self.bias.dtype)
            if not bool(torch.isfinite(bias).all()):
                raise ValueError(
                    f"{self.name}.bias: non-finite values (in {self.bias.dtype}); nothing was loaded"
                )
        return StagedWeight(data, scale_inv.float(), bias)

    @torch.no_grad()
    def commit(self, staged: StagedWeight) -> None:
        """Store a weight `stage_quantized` accepted (cannot fail: shapes were checked)."""
        self.weight_fp8.copy_(staged.data)
        self.weight_scale_inv.copy_(staged.scale_inv)
        if staged.bias is not None:
            self.bias.copy_(staged.bias)  # type: ignore[union-attr]
        self.loaded = True

    def _check_shape(self, t: torch.Tensor, what: str) -> None:
        if tuple(t.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"{self.name}: {what} shape {tuple(t.shape)} != "
                f"(out_features, in_features) = ({self.out_features}, {self.in_features})"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.loaded:
            raise RuntimeError(f"{self.name}: no weight loaded; call load_weight() first")
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self.name}: input last dim {x.shape[-1]} != in_features {self.in_features}"
            )
        x2 = x.reshape(-1, self.in_features)
        qx = _quantize_activation(x2, self.config, self.quantizer, f"{self.name}.input")
        out = fp8_linear_forward(
            qx, self.weight_quantized, self.bias, x.dtype, exact=self.config.exact_gemm
        )
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, quantizer={self.quantizer!r}, config={self.config}"
        )
