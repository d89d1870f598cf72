"""The parts a `nemo_jetrl.recipe.Recipe` is made of: `SideRecipe` (which linears one side of
an RL step runs in FP8, in which format, with which scale rule and quantizer), `KvCalibration`
(how the trainer recalibrates FP8 KV scales), and the allowed values of their fields (the
``Literal`` types, their tuples, and `QUANTIZER_FORMULA`). Plain Python, no torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

Side = Literal["train", "rollout"]
Fp8RecipeFormat = Literal["e4m3", "hybrid"]
Scaling = Literal["blockwise", "mxfp8", "tensorwise", "delayed"]
Quantizer = Literal["te", "jetrl", "vllm"]
KvCacheDtype = Literal["auto", "fp8"]
KvScaleSource = Literal["none", "trainer_calibrated", "checkpoint", "dynamic", "unit"]
KvMask = Literal["response", "prompt_and_response", "none"]
KvReduction = Literal["max", "percentile"]

FP8_RECIPE_FORMATS: tuple[str, ...] = ("e4m3", "hybrid")
SCALINGS: tuple[str, ...] = ("blockwise", "mxfp8", "tensorwise", "delayed")
QUANTIZERS: tuple[str, ...] = ("te", "jetrl", "vllm")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8")
KV_SCALE_SOURCES: tuple[str, ...] = ("none", "trainer_calibrated", "checkpoint", "dynamic", "unit")
KV_MASKS: tuple[str, ...] = ("response", "prompt_and_response", "none")
# TE's one switch of Float8BlockScaling's scale rule ("1": exact FP32 quotients; unset or "0":
# power-of-two scales), read once when TE is imported. Its home: the config keys and the
# Megatron mapping both name it from here.
FP32_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
KV_REDUCTIONS: tuple[str, ...] = ("max", "percentile")

# Which quantization *formula* each implementation computes. TE and this package compute the
# same one (bit-exact against TE's golden vectors); vLLM's own functions compute another.
QUANTIZER_FORMULA: Mapping[str, str] = MappingProxyType({"te": "te", "jetrl": "te", "vllm": "vllm"})


@dataclass(frozen=True)
class SideRecipe:
    """Precision of one side (training or rollout) of an RL step."""

    fp8_linears: bool = False
    """Linear layers of the decoder blocks (q/k/v/o projections, MLP) run in FP8. Embeddings,
    norms, attention math, lm_head and MoE routers always stay BF16 on both sides."""

    fmt: Fp8RecipeFormat = "e4m3"
    """TE's `fp8` knob: "e4m3" everywhere, or "hybrid" (E4M3 forward, E5M2 gradients). Forward
    tensors are E4M3 in both, so only training backward differs. Rollout is always "e4m3"."""

    scaling: Scaling = "blockwise"
    """Scaling granularity: "blockwise" (1x128 activations, 128x128 weights; the only one this
    package quantizes), "mxfp8" (1x32 E8M0), or TE's per-tensor "tensorwise"/"delayed"."""

    pow2_weight_scales: bool = True
    """Weight block scales are powers of two (True) or exact FP32 quotients (False)."""

    pow2_activation_scales: bool = True
    """Activation block scales are powers of two (True) or exact FP32 quotients (False)."""

    quantizer: Quantizer = "te"
    """Which code computes the quantization on this side: "te" (Transformer Engine), "jetrl"
    (nemo_jetrl.fp8; on rollout this means our vLLM patch), "vllm" (vLLM's own kernels)."""

    bf16_first_layers: int = 0
    """Number of leading decoder layers kept in BF16 on this side."""

    bf16_last_layers: int = 0
    """Number of trailing decoder layers kept in BF16 on this side."""

    bf16_layer_kws: tuple[str, ...] = ()
    """Decoder linears whose HF name (``model.layers.3.self_attn.q_proj``) contains any of these
    words stay BF16 on this side (rollout: NeMo-RL's ``quantization_ignored_layer_kws``; training:
    ``jetrl.train_bf16_layer_kws``). vLLM and Megatron fuse q/k/v and gate/up into one GEMM, so a
    list must keep a fused group whole (`config.validate` refuses a split group)."""

    fp8_param: bool = False
    """Training only: TE keeps the primary weights in FP8 (`fp8_cfg.fp8_param`); refit may then
    export TE's own FP8 weights instead of requantizing the master copy."""

    use_deep_gemm: bool = False
    """Rollout only: the GEMM uses DeepGEMM. Changes the kernel, never the quantized inputs."""

    def __post_init__(self) -> None:
        problems = []
        if self.fmt not in FP8_RECIPE_FORMATS:
            problems.append(f"fmt={self.fmt!r} (allowed: {', '.join(FP8_RECIPE_FORMATS)})")
        if self.scaling not in SCALINGS:
            problems.append(f"scaling={self.scaling!r} (allowed: {', '.join(SCALINGS)})")
        if self.quantizer not in QUANTIZERS:
            problems.append(f"quantizer={self.quantizer!r} (allowed: {', '.join(QUANTIZERS)})")
        for name in ("bf16_first_layers", "bf16_last_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                problems.append(f"{name}={v!r} (must be an integer >= 0)")
        kws = self.bf16_layer_kws
        if isinstance(kws, (list, tuple)) and all(isinstance(k, str) and k for k in kws):
            object.__setattr__(self, "bf16_layer_kws", tuple(kws))  # lists from JSON/YAML
        else:
            problems.append(f"bf16_layer_kws={kws!r} (must be a list of non-empty strings)")
        if problems:
            raise ValueError("invalid SideRecipe: " + "; ".join(problems))

    @property
    def pow2_scales(self) -> bool:
        """The scale mode when weights and activations agree; ValueError when they differ."""
        if self.pow2_weight_scales != self.pow2_activation_scales:
            raise ValueError(
                "this side mixes scale modes (pow2 weights="
                f"{self.pow2_weight_scales}, pow2 activations={self.pow2_activation_scales}); "
                "read pow2_weight_scales / pow2_activation_scales separately"
            )
        return self.pow2_weight_scales

    @property
    def formula(self) -> str:
        """The quantization formula this side's implementation computes ("te" or "vllm")."""
        return QUANTIZER_FORMULA[self.quantizer]

    def scale_mode(self, tensor: Literal["weight", "activation"]) -> str:
        """Scale mode, "pow2" or "fp32", of weights or activations on this side."""
        pow2 = self.pow2_weight_scales if tensor == "weight" else self.pow2_activation_scales
        return "pow2" if pow2 else "fp32"

    def is_fp8_layer(self, layer: int, num_layers: int) -> bool:
        """Whether decoder layer `layer` (0-based) of `num_layers` runs its linears in FP8."""
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer index {layer} out of range for a {num_layers}-layer model")
        if not self.fp8_linears:
            return False
        return self.bf16_first_layers <= layer < num_layers - self.bf16_last_layers

    def keeps_bf16(self, linear_name: str) -> bool:
        """Whether the linear named ``linear_name`` (HF prefix) is on this side's BF16 list."""
        return any(kw in linear_name for kw in self.bf16_layer_kws)

    def is_fp8_linear(self, linear_name: str, layer: int, num_layers: int) -> bool:
        """Whether that linear of decoder layer ``layer`` runs in FP8 on this side."""
        return self.is_fp8_layer(layer, num_layers) and not self.keeps_bf16(linear_name)

    def fp8_layers(self, num_layers: int) -> list[int]:
        """Indices of the decoder layers whose linears run in FP8 on this side."""
        return [i for i in range(num_layers) if self.is_fp8_layer(i, num_layers)]

    def with_(self, **changes: Any) -> SideRecipe:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


# NeMo-RL's defaults for trainer-side KV calibration (its calibrate_qkv_fp8_scales arguments):
# the one place these numbers are written; every default elsewhere refers to them.
KV_DATA_FRACTION = 1.0
KV_PERCENTILE = 99.9
KV_MARGIN = 1.05
KV_MASK: KvMask = "prompt_and_response"


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# field -> (accepts, what it must be): the rules of a KV calibration, shared by `KvCalibration`,
# `nemo_jetrl.kvcache.settings.CalibrationSettings` and the config validator.
KV_CALIBRATION_RULES: Mapping[str, tuple[Callable[[Any], bool], str]] = MappingProxyType(
    {
        "data_fraction": (lambda v: _real(v) and 0.0 < v <= 1.0, "a number in (0, 1]"),
        "percentile": (lambda v: _real(v) and 0.0 < v <= 100.0, "a number in (0, 100]"),
        "margin": (
            lambda v: _real(v) and v >= 1.0,
            "a finite number >= 1 (a safety factor on amax)",
        ),
        "mask": (lambda v: v in KV_MASKS, "one of " + ", ".join(KV_MASKS)),
        "reduction": (
            lambda v: v is None or v in KV_REDUCTIONS,
            "one of " + ", ".join(KV_REDUCTIONS) + " (or null)",
        ),
        "include_q": (lambda v: v is None or isinstance(v, bool), "true or false (or null)"),
        "micro_batch_size": (
            lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
            "an integer > 0 (or null)",
        ),
    }
)


def kv_calibration_problems(values: Mapping[str, Any]) -> dict[str, str]:
    """``{field: what it must be}`` for every field of ``values`` that breaks its rule."""
    return {
        k: what
        for k, v in values.items()
        if k in KV_CALIBRATION_RULES
        for ok, what in [KV_CALIBRATION_RULES[k]]
        if not ok(v)
    }


@dataclass(frozen=True)
class KvCalibration:
    """How the trainer recalibrates per-tensor Q/K/V scales for an FP8 KV cache (issue 6)."""

    enabled: bool = True
    """Recalibrate after every update and send the scales with the refit."""

    data_fraction: float = KV_DATA_FRACTION
    """Fraction of the step's sequences (0 < f <= 1) the observers see."""

    percentile: float = KV_PERCENTILE
    """Percentile (0 < p <= 100) of the per-micro-batch amax values; 100 means the maximum."""

    margin: float = KV_MARGIN
    """Safety margin (>= 1) multiplied into the amax before scale = amax * margin / 448."""

    mask: KvMask = KV_MASK
    """Tokens the observers see: "response" (generated tokens only), "prompt_and_response" (all
    real tokens), "none" (everything including padding, NeMo-RL's behaviour)."""

    reduction: KvReduction | None = None
    """How the per-micro-batch amax samples are reduced: "max" or "percentile". None: "max" when
    percentile is 100, else "percentile"."""

    include_q: bool | None = None
    """Also calibrate the query scale (attention kernels that take FP8 queries). None: the backend
    decides (local backend: yes; NeMo-RL: when NeMo-RL asks for it). Under NeMo-RL, true adds
    q_scale; false cannot drop a q_scale NeMo-RL asks for (its engine needs it)."""

    micro_batch_size: int | None = None
    """Sequences per calibration forward pass (> 0; one amax sample per pass). None: the backend's
    default (local backend: 32; NeMo-RL: what NeMo-RL passes, else its logprob_batch_size); a
    value here wins over both."""

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        problems = kv_calibration_problems(values)
        if problems:
            raise ValueError(
                "invalid KvCalibration: "
                + "; ".join(f"{k}={values[k]!r} (must be {what})" for k, what in problems.items())
            )
