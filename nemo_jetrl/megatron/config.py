"""Recipe -> Megatron-Core ``TransformerConfig`` fields, TE blockwise settings and env vars.

What Megatron-Core 0.16 reads (``megatron/core/transformer/transformer_config.py``):

- ``fp8``: ``"e4m3"`` (E4M3 everywhere) or ``"hybrid"`` (E4M3 forward, E5M2 gradients); ``None``
  turns FP8 off.
- ``fp8_recipe``: ``"blockwise"`` selects TE's ``Float8BlockScaling`` (1x128 activations and
  gradients, 128x128 weights). Megatron builds it with ``Float8BlockScaling(fp8_format=...)`` only
  (``megatron/core/fp8_utils.py``), so every other setting comes from TE's class defaults.
- ``fp8_param``: TE keeps the primary weights in FP8 (``Float8BlockwiseQTensor``).
- ``first_last_layers_bf16`` with ``num_layers_at_start_in_bf16`` / ``num_layers_at_end_in_bf16``:
  those decoder layers run outside ``fp8_autocast``. Megatron's defaults for the two counts are 1,
  so both are always written explicitly.

Why an environment variable matters. TE decides the *scale rule* of ``Float8BlockScaling`` when its
module ``transformer_engine.common.recipe`` is executed: the class body evaluates
``os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"`` and bakes
``QParams(power_2_scale=not use_f32_scales)`` into the class attributes ``fp8_quant_fwd_inp``,
``fp8_quant_fwd_weight`` and ``fp8_quant_bwd_grad`` (they are not constructor fields, so nothing
passed to ``Float8BlockScaling(...)`` changes them). Setting the variable after TE was imported has
no effect. Therefore:

- `ensure_te_scale_env` sets the variable, and refuses with `TeScaleEnvConflict` when TE's recipe
  module is already loaded with the other rule (the process must be restarted with the variable).
- On a cluster the NeMo-RL backend puts the variable into ``policy.megatron_cfg.env_vars``; NeMo-RL
  passes those to the Ray actors' ``runtime_env`` (``lm_policy.Policy`` -> ``RayWorkerGroup``), so
  the Megatron policy workers start with it set *before* any import of TE. Our worker extension
  then calls `ensure_te_scale_env` again, which proves it (or fails loudly).

The scale rule is one switch for inputs, weights and gradients: a recipe whose training side mixes
power-of-two weight scales with FP32 activation scales cannot be expressed in TE and is refused.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from nemo_jetrl._optional import require
from nemo_jetrl.recipe import Recipe
from nemo_jetrl.recipe_parts import FP32_SCALES_ENV, SideRecipe

TE_RECIPE_MODULE = "transformer_engine.common.recipe"
# TE's Format enum member for each Megatron/recipe format string.
TE_FORMATS: Mapping[str, str] = MappingProxyType({"e4m3": "E4M3", "hybrid": "HYBRID"})
# The QParams class attributes of Float8BlockScaling that carry the scale rule.
TE_QPARAMS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


class MegatronRecipeError(ValueError):
    """A recipe that Megatron-Core/TE cannot express; the message says what to change."""


class TeScaleEnvConflict(RuntimeError):
    """TE was imported with the other blockwise scale rule than the recipe needs."""


@dataclass(frozen=True)
class TeBlockScaling:
    """The settings TE's ``Float8BlockScaling`` must have for the training side of a recipe."""

    fp8_format: str = "E4M3"
    """TE ``Format`` member name: "E4M3" or "HYBRID" (E5M2 gradients)."""

    power_2_scale: bool = True
    """``QParams.power_2_scale`` of inputs, weights and gradients (TE has one switch for all)."""

    amax_epsilon: float = 0.0
    """``QParams.amax_epsilon``: TE's default and our spec's eps."""

    x_block_scaling_dim: int = 1
    """Activations: 1 = 1x128 blocks, 2 = 128x128 blocks (TE's defaults, the only layout this
    package emulates)."""

    w_block_scaling_dim: int = 2
    """Weights: 128x128 blocks."""

    grad_block_scaling_dim: int = 1
    """Gradients: 1x128 blocks."""

    @property
    def env_value(self) -> str:
        """The ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` value that gives this scale rule."""
        return "0" if self.power_2_scale else "1"


@dataclass(frozen=True)
class MegatronFp8Settings:
    """Everything the training side needs from a recipe, in Megatron/TE terms."""

    transformer_config: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``megatron.core.transformer.TransformerConfig`` (FP8 fields only)."""

    env_vars: Mapping[str, str] = field(default_factory=dict)
    """Environment variables the training process must have before TE is imported."""

    te_recipe: TeBlockScaling | None = None
    """TE Float8BlockScaling settings, or None when training is not blockwise FP8."""


def _train_scale_rule(train: SideRecipe) -> bool:
    """True for power-of-two scales; refuses a mix TE cannot express."""
    if train.pow2_weight_scales != train.pow2_activation_scales:
        raise MegatronRecipeError(
            "the training side mixes scale rules (power-of-two weights="
            f"{train.pow2_weight_scales}, power-of-two activations={train.pow2_activation_scales}); "
            f"TE's Float8BlockScaling has one switch ({FP32_SCALES_ENV}) for inputs, weights and "
            "gradients: use the same rule for both"
        )
    return train.pow2_weight_scales


def _layer_problems(train: SideRecipe, num_layers: int, pipeline_parallel_size: int) -> list[str]:
    """Why Megatron would refuse the recipe's BF16 first/last layers or scaling (empty: fine)."""
    problems = []
    if num_layers < 1:
        problems.append(f"num_layers={num_layers} must be >= 1")
    per_stage = max(num_layers // max(pipeline_parallel_size, 1), 0)
    for what, n in (("first", train.bf16_first_layers), ("last", train.bf16_last_layers)):
        if n > per_stage:
            problems.append(
                f"{n} BF16 {what} layers exceed the {per_stage} layers of a pipeline stage "
                f"(Megatron's limit num_layers // pipeline_model_parallel_size); lower "
                f"jetrl.train_num_{what}_layers_in_bf16"
            )
    if train.bf16_first_layers + train.bf16_last_layers >= num_layers > 0:
        problems.append(
            f"BF16 first ({train.bf16_first_layers}) + last ({train.bf16_last_layers}) layers "
            f"cover all {num_layers} layers: no layer would run in FP8"
        )
    if train.fp8_param and train.scaling == "delayed":
        problems.append("fp8_param with delayed scaling is not supported by this package")
    if (train.bf16_first_layers > 0 or train.bf16_last_layers > 0) and train.scaling == "delayed":
        problems.append(
            "Megatron refuses first/last BF16 layers with delayed scaling: use fp8_recipe=blockwise"
        )
    return problems


def built_bf16_edges_problem(config: Any, train: SideRecipe) -> str | None:
    """Why a built model's ``TransformerConfig`` trains other BF16 first/last layers than the
    recipe (None: the same). A model provider may set them itself: Megatron-Bridge's Nemotron-H
    sets ``first_last_layers_bf16`` (one layer at each end), which NeMo-RL's ``fp8_cfg`` never
    resets, where the recipe trains and the rollout quantizes those layers in FP8."""
    if not train.fp8_linears or not getattr(config, "fp8", None):
        return None
    on = bool(getattr(config, "first_last_layers_bf16", False))
    built = (
        int(getattr(config, "num_layers_at_start_in_bf16", 0)) if on else 0,
        int(getattr(config, "num_layers_at_end_in_bf16", 0)) if on else 0,
    )
    if built == (train.bf16_first_layers, train.bf16_last_layers):
        return None
    return (
        f"the model was built with {built[0]} first and {built[1]} last decoder layers in BF16 "
        f"(TransformerConfig.first_last_layers_bf16={on}, set by its Megatron-Bridge provider, "
        "e.g. Nemotron-H's), where the recipe trains "
        f"{train.bf16_first_layers} and {train.bf16_last_layers}: those layers' training forward "
        "would not be the rollout's. NeMo-RL's fp8_cfg has no key to change it: train this "
        "model in BF16 (policy.megatron_cfg.fp8_cfg.enabled=false, with a BF16 rollout)"
    )


def megatron_fp8_settings(
    recipe: Recipe, *, num_layers: int, pipeline_parallel_size: int = 1
) -> MegatronFp8Settings:
    """The Megatron ``TransformerConfig`` FP8 fields, TE settings and env vars for ``recipe``.

    ``num_layers`` is the model's decoder layer count (Megatron checks the BF16 first/last counts
    against ``num_layers // pipeline_parallel_size``; so do we, with the YAML-facing message).
    """
    train = recipe.train
    if not train.fp8_linears:
        return MegatronFp8Settings(
            transformer_config=MappingProxyType({"fp8": None, "fp8_param": False}),
        )
    problems = _layer_problems(train, num_layers, pipeline_parallel_size)
    try:
        pow2 = _train_scale_rule(train)
    except MegatronRecipeError as exc:
        problems.append(str(exc))
        pow2 = True
    if problems:
        raise MegatronRecipeError(
            f"recipe {recipe.name!r} cannot be mapped onto Megatron-Core: " + "; ".join(problems)
        )
    tc = {
        "fp8": train.fmt,
        "fp8_recipe": train.scaling,
        "fp8_param": train.fp8_param,
        "first_last_layers_bf16": train.bf16_first_layers > 0 or train.bf16_last_layers > 0,
        "num_layers_at_start_in_bf16": train.bf16_first_layers,
        "num_layers_at_end_in_bf16": train.bf16_last_layers,
    }
    if train.scaling != "blockwise":
        return MegatronFp8Settings(transformer_config=MappingProxyType(tc))
    te = TeBlockScaling(fp8_format=TE_FORMATS[train.fmt], power_2_scale=pow2)
    return MegatronFp8Settings(
        transformer_config=MappingProxyType(tc),
        env_vars=MappingProxyType({FP32_SCALES_ENV: te.env_value}),
        te_recipe=te,
    )


def te_block_scaling(recipe: Recipe) -> TeBlockScaling:
    """TE Float8BlockScaling settings of the training side (MegatronRecipeError if not blockwise)."""
    train = recipe.train
    if not train.fp8_linears or train.scaling != "blockwise":
        raise MegatronRecipeError(
            f"recipe {recipe.name!r} does not train with blockwise FP8 (fp8_linears="
            f"{train.fp8_linears}, scaling={train.scaling!r}): it has no Float8BlockScaling"
        )
    return TeBlockScaling(fp8_format=TE_FORMATS[train.fmt], power_2_scale=_train_scale_rule(train))


def build_transformer_config(recipe: Recipe, **model_fields: Any) -> Any:
    """A real ``megatron.core`` ``TransformerConfig`` of ``model_fields`` plus the recipe's FP8 fields.

    Fields given in ``model_fields`` that the recipe also sets must agree with it; a model whose
    TE training blocks would not be the rollout's (`blocks.block_layout_problems`: fused
    ``linear_qkv`` with a head dim that is not a multiple of 128, tensor-parallel shards that
    cut 128-blocks) is refused when both sides run FP8 linears.
    """
    tc_mod = require(
        "megatron.core.transformer.transformer_config",
        feature="building a Megatron TransformerConfig",
    )
    num_layers = int(model_fields.get("num_layers", 0))
    pp = int(model_fields.get("pipeline_model_parallel_size", 1))
    settings = megatron_fp8_settings(recipe, num_layers=num_layers, pipeline_parallel_size=pp)
    clashes = [
        f"{k}={model_fields[k]!r} (recipe needs {v!r})"
        for k, v in settings.transformer_config.items()
        if k in model_fields and model_fields[k] != v
    ]
    if clashes:
        raise MegatronRecipeError(
            "model fields contradict the recipe: "
            + "; ".join(clashes)
            + ": drop them from the model config and let the recipe set them"
        )
    config = tc_mod.TransformerConfig(**{**model_fields, **settings.transformer_config})
    if recipe.rollout.fp8_linears:  # the rollout's FP8 blocks must be training's
        from nemo_jetrl.megatron.blocks import block_layout_problem

        why = block_layout_problem(config, recipe.train)
        if why:
            raise MegatronRecipeError(f"recipe {recipe.name!r}: {why}")
    return config


# -- the TE import-time environment variable ------------------------------------------------------


def te_loaded_scale_rule(modules: Mapping[str, Any] | None = None) -> bool | None:
    """The power-of-two switch baked into the loaded TE recipe module, or None if not loaded."""
    modules = sys.modules if modules is None else modules
    mod = modules.get(TE_RECIPE_MODULE)
    if mod is None:
        return None
    cls = getattr(mod, "Float8BlockScaling", None)
    if cls is None:
        return None
    rules = {name: bool(getattr(cls, name).power_2_scale) for name in TE_QPARAMS}
    if len(set(rules.values())) != 1:
        raise TeScaleEnvConflict(f"TE's Float8BlockScaling mixes scale rules: {rules}")
    return next(iter(rules.values()))


@dataclass
class EnvHandle:
    """Reverts what `ensure_te_scale_env` changed in the environment (idempotent)."""

    environ: MutableMapping[str, str]
    key: str
    previous: str | None
    _active: bool = True

    def revert(self) -> None:
        if not self._active:
            return
        if self.previous is None:
            self.environ.pop(self.key, None)
        else:
            self.environ[self.key] = self.previous
        self._active = False

    def __enter__(self) -> EnvHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.revert()


def ensure_te_scale_env(
    pow2_scales: bool,
    *,
    environ: MutableMapping[str, str] | None = None,
    modules: Mapping[str, Any] | None = None,
) -> EnvHandle:
    """Make TE's blockwise scale rule ``pow2_scales`` in this process and its children.

    Sets ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` ("0" for power-of-two, "1" for FP32). If TE's
    recipe module is already imported with the other rule, raises `TeScaleEnvConflict`: TE read
    the variable when the class was defined, so only a fresh process can change it. Returns a
    handle whose ``revert()`` restores the previous value.
    """
    environ = os.environ if environ is None else environ
    want = "0" if pow2_scales else "1"
    loaded = te_loaded_scale_rule(modules)
    if loaded is not None and loaded != pow2_scales:
        have = "power-of-two" if loaded else "FP32"
        need = "power-of-two" if pow2_scales else "FP32"
        raise TeScaleEnvConflict(
            f"Transformer Engine was already imported with {have} blockwise scales "
            f"({FP32_SCALES_ENV}={environ.get(FP32_SCALES_ENV, '<unset>')!r} at import), but the "
            f"recipe needs {need} scales ({FP32_SCALES_ENV}={want}). TE reads this variable once, "
            "when transformer_engine.common.recipe is imported: set "
            f"policy.megatron_cfg.env_vars.{FP32_SCALES_ENV}={want!r} (NeMo-RL passes it to the "
            "workers before they import TE) or export it before starting Python"
        )
    handle = EnvHandle(environ, FP32_SCALES_ENV, environ.get(FP32_SCALES_ENV))
    environ[FP32_SCALES_ENV] = want
    return handle


def build_te_recipe(recipe: Recipe) -> Any:
    """TE's own ``Float8BlockScaling`` for the training side, checked against the recipe.

    Sets the env var first (see `ensure_te_scale_env`), imports TE's recipe module, constructs the
    dataclass as Megatron does (``fp8_format`` only) and verifies that its baked-in scale rule,
    block dims and epsilon are what the recipe needs.
    """
    te = te_block_scaling(recipe)
    ensure_te_scale_env(te.power_2_scale)
    mod = require(TE_RECIPE_MODULE, feature="TE's Float8BlockScaling recipe")
    obj = mod.Float8BlockScaling(fp8_format=getattr(mod.Format, te.fp8_format))
    check_te_recipe(obj, te)
    return obj


def check_te_recipe(obj: Any, want: TeBlockScaling) -> None:
    """Raise MegatronRecipeError listing every field of a TE Float8BlockScaling that differs."""
    diffs = []
    fmt = getattr(obj.fp8_format, "name", str(obj.fp8_format))
    if fmt != want.fp8_format:
        diffs.append(f"fp8_format={fmt} (want {want.fp8_format})")
    for name in TE_QPARAMS:
        q = getattr(obj, name)
        if bool(q.power_2_scale) != want.power_2_scale:
            diffs.append(
                f"{name}.power_2_scale={q.power_2_scale} (want {want.power_2_scale}: "
                f"{FP32_SCALES_ENV} was {'1' if want.power_2_scale else '0/unset'} when TE was imported)"
            )
        if float(q.amax_epsilon) != want.amax_epsilon:
            diffs.append(f"{name}.amax_epsilon={q.amax_epsilon} (want {want.amax_epsilon})")
    for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
        if getattr(obj, name) != getattr(want, name):
            diffs.append(f"{name}={getattr(obj, name)} (want {getattr(want, name)})")
    # TE >= 2.15 reads NVTE_BACKWARD_OVERRIDE at import: another backward than the recipe's
    override = getattr(obj, "backward_override", None)
    if override is not None:
        diffs.append(
            f"backward_override={override!r} (want None: unset NVTE_BACKWARD_OVERRIDE, which "
            "switches TE's backward GEMMs to other precisions than the recipe's 1x128/128x1)"
        )
    if diffs:
        raise MegatronRecipeError(
            "TE Float8BlockScaling differs from the recipe: " + "; ".join(diffs)
        )
