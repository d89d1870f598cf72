"""Recipes: what is FP8 where, on the training side and on the rollout side of an RL step.

An RL step has two sides that must agree on numbers. The *training* side (Megatron-Core with
Transformer Engine, or this package's CPU emulation) runs forward and backward; the *rollout*
side (vLLM) samples. A recipe says, per side, which linear layers run in FP8, in which format,
with which scale rule, and which piece of code computes the quantization. The rollout is on-policy
exactly when every tensor that is FP8 in rollout is FP8 in the training forward with the same
format, block shape, scale rule and an implementation that produces the same bits
(`nemo_jetrl.flow.check` checks that; this module only describes).

Scale rules, in plain words (see DESIGN.md for the exact spec):

- ``pow2``: the per-block scale ``448/amax`` is rounded down to a power of two. Multiplying or
  dividing by a power of two is exact, so Transformer Engine's formula (``x * (448/amax)``) and
  vLLM's formula (``x / (amax/448)``) give the same bits.
- ``fp32``: the scale is the exact FP32 quotient. TE multiplies by ``RN(448/amax)``, vLLM divides
  by ``RN(amax/448)``; the two round differently (measured: 28% of dequantized activations
  differ), so FP32 scales are on-policy only when one quantizer serves both sides (our vLLM patch).

The module is plain Python (no torch) so that `jetrl check` stays light. Backends derive their
settings from a Recipe: the local CPU backend builds `nemo_jetrl.fp8` linears, the vLLM patch
builds engine arguments, the Megatron mapping builds TransformerConfig fields and NVTE env vars.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
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
KV_REDUCTIONS: tuple[str, ...] = ("max", "percentile")
PRESET_NAMES: tuple[str, ...] = ("bf16", "fp8_rollout", "jetrl", "jetrl_kv")

# Which quantization *formula* each implementation computes. TE and this package compute the
# same one (bit-exact against TE's golden vectors); vLLM's own functions compute another.
QUANTIZER_FORMULA: Mapping[str, str] = MappingProxyType({"te": "te", "jetrl": "te", "vllm": "vllm"})


@dataclass(frozen=True)
class SideRecipe:
    """Precision of one side (training or rollout) of an RL step."""

    # Linear layers of the decoder blocks (q/k/v/o projections, MLP) run in FP8. Embeddings,
    # norms, attention math, lm_head and MoE routers always stay BF16 on both sides.
    fp8_linears: bool = False
    # TE's `fp8` knob: "e4m3" everywhere, or "hybrid" (E4M3 forward, E5M2 gradients). Forward
    # tensors are E4M3 in both, so only training backward differs. Rollout is always "e4m3".
    fmt: Fp8RecipeFormat = "e4m3"
    # Scaling granularity: "blockwise" (1x128 activations, 128x128 weights; the only one this
    # package quantizes), "mxfp8" (1x32 E8M0), or TE's per-tensor "tensorwise"/"delayed".
    scaling: Scaling = "blockwise"
    # Weight block scales are powers of two (True) or exact FP32 quotients (False).
    pow2_weight_scales: bool = True
    # Activation block scales are powers of two (True) or exact FP32 quotients (False).
    pow2_activation_scales: bool = True
    # Which code computes the quantization on this side: "te" (Transformer Engine), "jetrl"
    # (nemo_jetrl.fp8; on rollout this means our vLLM patch), "vllm" (vLLM's own kernels).
    quantizer: Quantizer = "te"
    # Number of leading decoder layers kept in BF16 on this side.
    bf16_first_layers: int = 0
    # Number of trailing decoder layers kept in BF16 on this side.
    bf16_last_layers: int = 0
    # Training only: TE keeps the primary weights in FP8 (`fp8_cfg.fp8_param`); refit may then
    # export TE's own FP8 weights instead of requantizing the master copy.
    fp8_param: bool = False
    # Rollout only: the GEMM uses DeepGEMM. Changes the kernel, never the quantized inputs.
    use_deep_gemm: bool = False

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

    def fp8_layers(self, num_layers: int) -> list[int]:
        """Indices of the decoder layers whose linears run in FP8 on this side."""
        return [i for i in range(num_layers) if self.is_fp8_layer(i, num_layers)]

    def with_(self, **changes: Any) -> SideRecipe:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class KvCalibration:
    """How the trainer recalibrates per-tensor Q/K/V scales for an FP8 KV cache (issue 6)."""

    # Recalibrate after every update and send the scales with the refit.
    enabled: bool = True
    # Fraction of the step's sequences (0 < f <= 1) the observers see.
    data_fraction: float = 1.0
    # Percentile (0 < p <= 100) of the per-micro-batch amax values; 100 means the maximum.
    percentile: float = 99.9
    # Safety margin (>= 1) multiplied into the amax before scale = amax * margin / 448.
    margin: float = 1.05
    # Tokens the observers see: "response" (generated tokens only), "prompt_and_response"
    # (all real tokens), "none" (everything including padding, NeMo-RL's behaviour).
    mask: KvMask = "prompt_and_response"
    # How the per-micro-batch amax samples are reduced: "max" or "percentile". None: "max" when
    # percentile is 100, else "percentile".
    reduction: KvReduction | None = None
    # Also calibrate the query scale (attention kernels that take FP8 queries). None: the
    # backend decides (local backend: yes; NeMo-RL: when NeMo-RL asks for it). Under NeMo-RL,
    # true adds q_scale; false cannot drop a q_scale NeMo-RL asks for (its engine needs it).
    include_q: bool | None = None
    # Sequences per calibration forward pass (> 0; one amax sample per pass). None: the
    # backend's default (local backend: 32; NeMo-RL: what NeMo-RL passes, else its
    # logprob_batch_size); a value here wins over both.
    micro_batch_size: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.reduction is not None and self.reduction not in KV_REDUCTIONS:
            problems.append(f"reduction={self.reduction!r} (allowed: {', '.join(KV_REDUCTIONS)})")
        if self.include_q is not None and not isinstance(self.include_q, bool):
            problems.append(f"include_q={self.include_q!r} (must be true or false)")
        mbs = self.micro_batch_size
        if mbs is not None and (isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1):
            problems.append(f"micro_batch_size={mbs!r} (must be an integer > 0)")
        if not 0.0 < float(self.data_fraction) <= 1.0:
            problems.append(f"data_fraction={self.data_fraction!r} (must be in (0, 1])")
        if not 0.0 < float(self.percentile) <= 100.0:
            problems.append(f"percentile={self.percentile!r} (must be in (0, 100])")
        if not float(self.margin) >= 1.0:
            problems.append(f"margin={self.margin!r} (must be >= 1)")
        if self.mask not in KV_MASKS:
            problems.append(f"mask={self.mask!r} (allowed: {', '.join(KV_MASKS)})")
        if problems:
            raise ValueError("invalid KvCalibration: " + "; ".join(problems))


@dataclass(frozen=True)
class Recipe:
    """Precision of a whole RL step: both sides, the KV cache, and the rules kept in BF16."""

    # Preset name, or "custom" when built from explicit config keys.
    name: str = "custom"
    # Training side (forward and backward).
    train: SideRecipe = field(default_factory=SideRecipe)
    # Rollout side (inference engine, forward only).
    rollout: SideRecipe = field(default_factory=lambda: SideRecipe(quantizer="vllm"))
    # Rollout KV cache dtype: "auto" (model dtype, BF16) or "fp8" (E4M3, per-tensor scales).
    kv_cache_dtype: KvCacheDtype = "auto"
    # Where the rollout's K/V (and Q) scales come from: "none" (no FP8 KV), "trainer_calibrated"
    # (trainer observes Q/K/V each step and sends scales with the refit), "checkpoint" (stored
    # with the weights, never updated), "dynamic" (vLLM computes them from its first batch),
    # "unit" (scale 1.0).
    kv_scale_source: KvScaleSource = "none"
    # The trainer's attention applies the rollout's KV quantization with the same scales
    # (straight-through gradient), keeping the KV edges inside the training forward graph.
    onpolicy_kv: bool = False
    # Trainer-side KV scale recalibration settings (used when kv_scale_source is
    # "trainer_calibrated").
    kv_calibration: KvCalibration = field(default_factory=KvCalibration)
    # Layers whose GEMM dims are not multiples of 128 stay BF16 on both sides (True), or the
    # config is rejected (False; TE's blockwise recipe cannot run them).
    unaligned_layers_bf16: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(
                f"kv_cache_dtype={self.kv_cache_dtype!r} (allowed: {', '.join(KV_CACHE_DTYPES)})"
            )
        if self.kv_scale_source not in KV_SCALE_SOURCES:
            problems.append(
                f"kv_scale_source={self.kv_scale_source!r} (allowed: {', '.join(KV_SCALE_SOURCES)})"
            )
        if self.kv_cache_dtype == "fp8" and self.kv_scale_source == "none":
            problems.append("kv_cache_dtype='fp8' needs a kv_scale_source other than 'none'")
        if self.kv_cache_dtype == "auto" and self.kv_scale_source != "none":
            problems.append("kv_scale_source must be 'none' when kv_cache_dtype='auto'")
        if self.onpolicy_kv and self.kv_cache_dtype != "fp8":
            problems.append("onpolicy_kv=True needs kv_cache_dtype='fp8'")
        if self.train.quantizer == "vllm":
            problems.append("train.quantizer='vllm' (training uses 'te' or 'jetrl')")
        if problems:
            raise ValueError(f"invalid Recipe {self.name!r}: " + "; ".join(problems))

    # -- presets -------------------------------------------------------------------------------

    @staticmethod
    def preset(name: str) -> Recipe:
        """The named preset: bf16, fp8_rollout, jetrl or jetrl_kv."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown recipe preset {name!r}: use one of {', '.join(PRESET_NAMES)}"
            ) from None

    # -- views ---------------------------------------------------------------------------------

    def side(self, which: Side) -> SideRecipe:
        """The SideRecipe for "train" or "rollout"."""
        if which not in ("train", "rollout"):
            raise ValueError(f"side must be 'train' or 'rollout', got {which!r}")
        return self.train if which == "train" else self.rollout

    @property
    def kv_fp8(self) -> bool:
        """The rollout KV cache is FP8."""
        return self.kv_cache_dtype == "fp8"

    @property
    def any_fp8(self) -> bool:
        """Anything is FP8 on either side."""
        return self.train.fp8_linears or self.rollout.fp8_linears or self.kv_fp8

    def train_fp8_layers(self, num_layers: int) -> list[int]:
        """Decoder layers whose linears are FP8 in training."""
        return self.train.fp8_layers(num_layers)

    def rollout_fp8_layers(self, num_layers: int) -> list[int]:
        """Decoder layers whose linears are FP8 in rollout."""
        return self.rollout.fp8_layers(num_layers)

    def is_bf16_layer(self, layer: int, num_layers: int, side: Side = "rollout") -> bool:
        """Whether decoder layer `layer` keeps its linears in BF16 on `side`."""
        return not self.side(side).is_fp8_layer(layer, num_layers)

    def with_(self, **changes: Any) -> Recipe:
        """A copy with some fields changed (name becomes "custom" unless given)."""
        changes.setdefault("name", "custom")
        return dataclasses.replace(self, **changes)

    def aligned_to_training(self, kv: Literal["onpolicy", "bf16"] = "onpolicy") -> Recipe:
        """The on-policy recipe whose rollout is derived from this recipe's training side.

        Training is the source of truth: the rollout runs FP8 exactly where training does, with
        the same scale modes and BF16 layers, through our quantizer (the vLLM patch). An FP8 KV
        cache is kept with on-policy KV and trainer-calibrated scales (``kv="onpolicy"``) or
        dropped (``kv="bf16"``); it is always dropped when training is BF16 (NeMo-RL allows an
        FP8 KV cache only with FP8 weights). Raises ValueError when the training scaling has no
        matching rollout (only blockwise can be aligned).
        """
        if kv not in ("onpolicy", "bf16"):
            raise ValueError(f"kv must be 'onpolicy' or 'bf16', got {kv!r}")
        t = self.train
        if t.fp8_linears and t.scaling != "blockwise":
            raise ValueError(
                f"training uses {t.scaling!r} FP8, which no rollout quantizer reproduces; "
                "only 'blockwise' training can be aligned"
            )
        rollout = SideRecipe(
            fp8_linears=t.fp8_linears,
            fmt="e4m3",
            scaling="blockwise",
            pow2_weight_scales=t.pow2_weight_scales,
            pow2_activation_scales=t.pow2_activation_scales,
            quantizer="jetrl" if t.fp8_linears else "vllm",
            bf16_first_layers=t.bf16_first_layers,
            bf16_last_layers=t.bf16_last_layers,
            use_deep_gemm=self.rollout.use_deep_gemm and t.fp8_linears,
        )
        keep_kv = self.kv_fp8 and kv == "onpolicy" and t.fp8_linears
        src = self.kv_scale_source if self.kv_scale_source == "unit" else "trainer_calibrated"
        aligned = dataclasses.replace(
            self,
            rollout=rollout,
            kv_cache_dtype="fp8" if keep_kv else "auto",
            kv_scale_source=src if keep_kv else "none",
            onpolicy_kv=keep_kv,
        )
        return dataclasses.replace(aligned, name=matching_preset(aligned) or "custom")

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (for logs and YAML)."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Recipe:
        """Inverse of `to_dict`."""
        d = dict(d)
        for key in ("train", "rollout"):
            if key in d and not isinstance(d[key], SideRecipe):
                d[key] = SideRecipe(**dict(d[key]))
        if "kv_calibration" in d and not isinstance(d["kv_calibration"], KvCalibration):
            d["kv_calibration"] = KvCalibration(**dict(d["kv_calibration"]))
        return Recipe(**d)

    def describe(self) -> str:
        """A few human lines, one per side plus the KV cache."""
        lines = [f"recipe: {self.name}"]
        for which in ("train", "rollout"):
            lines.append(f"  {which:8s}{describe_side(self.side(which))}")
        if self.kv_fp8:
            lines.append(
                f"  kv cache: fp8 e4m3 per-tensor, scales {self.kv_scale_source}, "
                f"on-policy KV in training: {'yes' if self.onpolicy_kv else 'no'}"
            )
        else:
            lines.append("  kv cache: bf16")
        return "\n".join(lines)


def describe_side(s: SideRecipe) -> str:
    """One line describing a side."""
    if not s.fp8_linears:
        return "linears bf16"
    if s.pow2_weight_scales == s.pow2_activation_scales:
        scales = "pow2" if s.pow2_weight_scales else "fp32"
    else:
        scales = f"weights {s.scale_mode('weight')}, activations {s.scale_mode('activation')}"
    parts = [f"linears fp8 {s.fmt} {s.scaling}", f"scales {scales}", f"quantizer {s.quantizer}"]
    if s.bf16_first_layers or s.bf16_last_layers:
        parts.append(f"bf16 first {s.bf16_first_layers} / last {s.bf16_last_layers} layers")
    return ", ".join(parts)


def _normalized(recipe: Recipe) -> Recipe:
    """Blank out settings without effect on numbers: FP8 details of a BF16 side, the training
    quantizer (TE and nemo_jetrl compute the same bits), DeepGEMM (a kernel choice)."""
    train = recipe.train.with_(quantizer="te")
    if not train.fp8_linears:
        train = SideRecipe()
    rollout = recipe.rollout.with_(use_deep_gemm=False)
    if not rollout.fp8_linears:
        rollout = SideRecipe(quantizer="vllm")
    return dataclasses.replace(
        recipe, name="", train=train, rollout=rollout, kv_calibration=KvCalibration()
    )


def preset_differences(recipe: Recipe, preset: Recipe) -> list[str]:
    """Fields (dotted) where `recipe` differs from `preset` in something that changes numbers
    (name, KV calibration settings, training quantizer and DeepGEMM are ignored)."""
    a, b = _normalized(recipe).to_dict(), _normalized(preset).to_dict()
    diffs: list[str] = []
    for key, va in a.items():
        if isinstance(va, dict):
            diffs += [
                f"{key}.{sub}: config {va[sub]!r}, preset {b[key][sub]!r}"
                for sub in va
                if va[sub] != b[key][sub]
            ]
        elif va != b[key]:
            diffs.append(f"{key}: config {va!r}, preset {b[key]!r}")
    return diffs


def matching_preset(recipe: Recipe, prefer: str | None = None) -> str | None:
    """The preset `recipe` is equivalent to (`prefer` first when it matches), or None."""
    names = ([prefer] if prefer in PRESETS else []) + list(PRESETS)
    for name in names:
        if not preset_differences(recipe, PRESETS[name]):
            return name
    return None


def _presets() -> Mapping[str, Recipe]:
    fp8_train = SideRecipe(fp8_linears=True, fmt="e4m3", quantizer="te")
    fp8_rollout_patched = SideRecipe(fp8_linears=True, fmt="e4m3", quantizer="jetrl")
    jetrl = Recipe(name="jetrl", train=fp8_train, rollout=fp8_rollout_patched)
    return MappingProxyType(
        {
            "bf16": Recipe(name="bf16"),
            # The common off-policy recipe: BF16 training, FP8 rollout with vLLM's own quantizer
            # and NeMo-RL's default FP32 scales.
            "fp8_rollout": Recipe(
                name="fp8_rollout",
                rollout=SideRecipe(
                    fp8_linears=True,
                    quantizer="vllm",
                    pow2_weight_scales=False,
                    pow2_activation_scales=False,
                ),
            ),
            # Unified precision flow: TE blockwise FP8 training with pow2 scales; the rollout
            # uses the same quantizer through our vLLM patch.
            "jetrl": jetrl,
            # jetrl plus an FP8 KV cache whose scales the trainer calibrates and whose
            # quantization the trainer's attention applies too.
            "jetrl_kv": dataclasses.replace(
                jetrl,
                name="jetrl_kv",
                kv_cache_dtype="fp8",
                kv_scale_source="trainer_calibrated",
                onpolicy_kv=True,
            ),
        }
    )


PRESETS: Mapping[str, Recipe] = _presets()
