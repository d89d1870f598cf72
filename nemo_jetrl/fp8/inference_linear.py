"""The rollout-side FP8 linear (``Fp8InferenceLinear``), the twin of `linear.Fp8BlockLinear`.

The weight is quantized once per refit (128x128) and activations 1x128 per call, then the same
forward function as training runs (`linear.fp8_linear_forward`): with the same quantizer this
is bit-identical to ``Fp8BlockLinear``'s forward, which is the on-policy promise at layer level.
``quantizer="vllm_native"`` emulates an unpatched vLLM instead (`vllm_native`), for the
off-policy baselines.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from nemo_jetrl.fp8 import finite_flags
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.dispatch import quantize_blockwise
from nemo_jetrl.fp8.linear import check_fp8_dims, fp8_linear_forward
from nemo_jetrl.fp8.quantize import BlockQuantized
from nemo_jetrl.fp8.staging import StagedWeight, quantized_weight_problem
from nemo_jetrl.fp8.vllm_native import per_block_cast_native, quantize_group_native

Quantizer = Literal["jetrl", "vllm_native"]
QUANTIZERS: tuple[str, ...] = ("jetrl", "vllm_native")


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
    deferred = finite_flags.sync_free(x2)  # CUDA: no host sync, a device flag instead
    fmt, pow2 = config.forward_format, config.pow2_scales
    # the quantizer sets the flag itself (Triton: in the same launch; the torch path: `note`),
    # not isnan + any + or after it: three launches fewer per layer per decode step
    flag = finite_flags.flag(name, x2.device) if deferred else None
    return quantize_blockwise(
        x2, config.ACTIVATION_BLOCK, fmt=fmt, pow2_scales=pow2, eps=config.eps, name=name,
        check_finite=not deferred, nonfinite_flag=flag,
    )  # fmt: skip


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
        device: torch.device | str | None = None,
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
        dev = {"device": device}
        self.register_buffer("weight_fp8", torch.zeros(out_features, in_features, dtype=fp8, **dev))
        self.register_buffer("weight_scale_inv", torch.ones(nb, kb, dtype=torch.float32, **dev))
        bias_buf = torch.zeros(out_features, dtype=bias_dtype, **dev) if bias else None
        self.register_buffer("bias", bias_buf)
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
        """A rollout layer holding ``linear``'s weight quantized now (and a copy of its bias), on
        ``linear``'s device (as `Fp8BlockLinear.from_linear`: both sides of a CUDA model on CUDA)."""
        has_bias = linear.bias is not None
        bias_dtype = linear.bias.dtype if has_bias else linear.weight.dtype
        layer = cls(
            linear.in_features, linear.out_features, has_bias, config=config,
            quantizer=quantizer, bias_dtype=bias_dtype, name=name, device=linear.weight.device,
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
        if x.device != self.weight_fp8.device:
            # else a Triton kernel fails deep in its launcher ("cpu tensor?") naming no layer
            raise ValueError(
                f"{self.name}: input on {x.device}, weight on {self.weight_fp8.device}; move the "
                f"layer with .to({str(x.device)!r}) (or build it from a linear on that device)"
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
