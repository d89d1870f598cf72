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

`Recipe`, the presets and the rules comparing a recipe with them live here; the parts
(`SideRecipe`, `KvCalibration`, the allowed values) live in `nemo_jetrl.recipe_parts` and are
importable from here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from nemo_jetrl.recipe_parts import (
    FP8_RECIPE_FORMATS,
    KV_CACHE_DTYPES,
    KV_MASKS,
    KV_REDUCTIONS,
    KV_SCALE_SOURCES,
    QUANTIZER_FORMULA,
    QUANTIZERS,
    SCALINGS,
    Fp8RecipeFormat,
    KvCacheDtype,
    KvCalibration,
    KvMask,
    KvReduction,
    KvScaleSource,
    Quantizer,
    Scaling,
    Side,
    SideRecipe,
)

__all__ = [
    "FP8_RECIPE_FORMATS",
    "KV_CACHE_DTYPES",
    "KV_MASKS",
    "KV_REDUCTIONS",
    "KV_SCALE_SOURCES",
    "PRESETS",
    "PRESET_NAMES",
    "QUANTIZERS",
    "QUANTIZER_FORMULA",
    "SCALINGS",
    "Fp8RecipeFormat",
    "KvCacheDtype",
    "KvCalibration",
    "KvMask",
    "KvReduction",
    "KvScaleSource",
    "Quantizer",
    "Recipe",
    "Scaling",
    "Side",
    "SideRecipe",
    "describe_side",
    "matching_preset",
    "preset_differences",
]

PRESET_NAMES: tuple[str, ...] = ("bf16", "fp8_rollout", "jetrl", "jetrl_kv")


@dataclass(frozen=True)
class Recipe:
    """Precision of a whole RL step: both sides, the KV cache, and the rules kept in BF16."""

    name: str = "custom"
    """Preset name, or "custom" when built from explicit config keys."""

    train: SideRecipe = field(default_factory=SideRecipe)
    """Training side (forward and backward)."""

    rollout: SideRecipe = field(default_factory=lambda: SideRecipe(quantizer="vllm"))
    """Rollout side (inference engine, forward only)."""

    kv_cache_dtype: KvCacheDtype = "auto"
    """Rollout KV cache dtype: "auto" (model dtype, BF16) or "fp8" (E4M3, per-tensor scales)."""

    kv_scale_source: KvScaleSource = "none"
    """Where the rollout's K/V (and Q) scales come from: "none" (no FP8 KV), "trainer_calibrated"
    (trainer observes Q/K/V each step and sends scales with the refit), "checkpoint" (stored
    with the weights, never updated), "dynamic" (vLLM computes them from its first batch),
    "unit" (scale 1.0)."""

    onpolicy_kv: bool = False
    """The trainer's attention applies the rollout's KV quantization with the same scales
    (straight-through gradient), keeping the KV edges inside the training forward graph."""

    kv_calibration: KvCalibration = field(default_factory=KvCalibration)
    """Trainer-side KV scale recalibration settings (used when kv_scale_source is
    "trainer_calibrated")."""

    unaligned_layers_bf16: bool = False
    """Layers whose GEMM dims are not multiples of 128 stay BF16 on both sides (True), or the
    config is rejected (False; TE's blockwise recipe cannot run them)."""

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

    def bf16_layer_kws(self) -> tuple[str, ...]:
        """Every word of either side's per-name BF16 list, in first-seen order."""
        return tuple(dict.fromkeys((*self.train.bf16_layer_kws, *self.rollout.bf16_layer_kws)))

    def with_bf16_layer_kws(self, kws: tuple[str, ...]) -> Recipe:
        """This recipe with ``kws`` as the per-name BF16 list of both sides (renamed "custom"
        when that makes it differ from its preset)."""
        out = dataclasses.replace(
            self,
            train=self.train.with_(bf16_layer_kws=tuple(kws)),
            rollout=self.rollout.with_(bf16_layer_kws=tuple(kws)),
        )
        return out if out == self else out.with_(name=matching_preset(out) or "custom")

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
    if s.scaling == "mxfp8":
        scales = "e8m0 (1x32 blocks)"  # MXFP8 scales are E8M0 whatever the pow2 flags say
    elif s.pow2_weight_scales == s.pow2_activation_scales:
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
