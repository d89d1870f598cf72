"""Validation of a loaded config: every problem, reported together.

`validate` never stops at the first problem: it walks the `jetrl:` section (schema in
`config_schema`), NeMo-RL's precision keys, NeMo-RL's importance-sampling rules for ``loss_fn``
(its ClippedPGLossConfig checks), the recipe's internal consistency, and, when the model is
known, the architecture (layer counts, 128-alignment for blockwise FP8). Each finding is a
`ConfigIssue` with the full key path, a message saying what to change, and the allowed values.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import DictConfig

from nemo_jetrl.config import schema as S
from nemo_jetrl.config.layer_lists import check_layer_lists
from nemo_jetrl.config.load import ConfigError, ConfigIssue, unresolvable
from nemo_jetrl.config.reader import _arch, _Reader, arch_from_config, read_recipe
from nemo_jetrl.config.run_keys import check_run_keys
from nemo_jetrl.config.sections import NO_SECTIONS, SectionProviders
from nemo_jetrl.recipe import Recipe, preset_differences
from nemo_jetrl.recipe_parts import KV_CALIBRATION_RULES, kv_calibration_problems

__all__ = ["arch_from_config", "errors", "recipe_from_config", "validate"]


def _check_jetrl_section(r: _Reader) -> None:
    section = r.get("jetrl", None)
    if section is None:
        return
    if not isinstance(section, Mapping):
        r.error("jetrl", f"must be a mapping, got {type(section).__name__}")
        return
    for key in section:
        if key not in S.JETRL_KEYS:
            near = difflib.get_close_matches(str(key), list(S.JETRL_KEYS), n=1)
            hint = f"; did you mean jetrl.{near[0]}?" if near else ""
            r.error(f"jetrl.{key}", f"unknown key{hint}", tuple(S.JETRL_KEYS))
    for key, spec in S.JETRL_KEYS.items():
        if key not in section or key in ("kv_calibration", "local"):
            continue
        v = section[key]
        path = f"jetrl.{key}"
        types = tuple(t for t in spec.types if t is not type(None))
        if v is None and type(None) in spec.types:
            continue
        ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
        if not ok:
            want = " or ".join(
                "null" if t is type(None) else getattr(t, "__name__", str(t)) for t in spec.types
            )
            r.error(path, f"must be {want}, got {v!r}", spec.choices)
            continue
        if spec.choices and v not in spec.choices:
            r.error(path, f"unknown value {v!r}", spec.choices)
        if spec.types == (int,) and v < 0:
            r.error(path, f"must be >= 0, got {v}")
    cal = section.get("kv_calibration")
    if cal is not None:
        if not isinstance(cal, Mapping):
            r.error("jetrl.kv_calibration", "must be a mapping")
        else:
            _check_kv_calibration(r, cal)
    local = section.get("local")
    if local is not None:
        _check_local(r, local)


def _check_kv_calibration(r: _Reader, cal: Mapping[str, Any]) -> None:
    base = "jetrl.kv_calibration"
    for key in cal:
        if key not in S.KV_CALIBRATION_KEYS:
            near = difflib.get_close_matches(str(key), list(S.KV_CALIBRATION_KEYS), n=1)
            hint = f"; did you mean {base}.{near[0]}?" if near else ""
            r.error(f"{base}.{key}", f"unknown key{hint}", tuple(S.KV_CALIBRATION_KEYS))
    r.boolean(f"{base}.enabled", True)
    values = {k: cal[k] for k in KV_CALIBRATION_RULES if k in cal}
    for key, what in kv_calibration_problems(values).items():
        allowed = S.KV_CALIBRATION_KEYS[key].choices
        v = values[key]
        if allowed and v not in allowed:
            r.error(
                f"{base}.{key}", f"unknown value {v!r}", tuple(c for c in allowed if c is not None)
            )
        else:
            r.error(f"{base}.{key}", f"must be {what}, got {v!r}")
    pct, reduction = values.get("percentile"), values.get("reduction")
    if reduction == "max" and pct is not None and pct != 100.0:
        r.warn(
            f"{base}.percentile",
            f"ignored: reduction is max (the percentile {pct} applies only with "
            "reduction: percentile)",
        )


def _check_local(r: _Reader, local: Any) -> None:
    if not isinstance(local, Mapping):
        r.error("jetrl.local", f"must be a mapping, got {type(local).__name__}")
        return
    section = r.section("local")
    if section is None:
        r.note(
            "jetrl.local",
            "not validated here (no local-backend schema was given; `jetrl check`, `align` and "
            "`train` validate it)",
        )
        return
    r.issues.extend(section.validate(r.cfg.jetrl.local, "jetrl.local"))
    r.issues.extend(section.validate_run(r.cfg))  # NeMo-RL keys only that backend restricts


def _check_nemo_rl_keys(r: _Reader) -> None:
    # Training FP8 (Megatron/TE).
    fp8_on = r.boolean(S.FP8_ENABLED, False)
    if fp8_on:
        for key, choices in ((S.FP8_FORMAT, S.FP8_FORMATS), (S.FP8_RECIPE, S.FP8_RECIPES)):
            if not r.has(key):
                r.error(key, "required when fp8_cfg.enabled is true (NeMo-RL reads it)", choices)
            else:
                r.choice(key, choices, choices[0])
        r.boolean(S.FP8_PARAM, False)
        if r.get(S.MEGATRON_ENABLED, None) is False:
            r.warn(
                S.FP8_ENABLED,
                "NeMo-RL applies fp8_cfg only with the Megatron backend "
                f"({S.MEGATRON_ENABLED}=false here); the local backend honours it",
            )
    env = r.get(S.FP32_SCALES_KEY, None)
    if env is not None and str(env) not in S.ENV_FLAG_VALUES:
        r.error(
            S.FP32_SCALES_KEY,
            f"unknown value {env!r}: TE treats only '1' as FP32 scales and anything else as "
            "power-of-two scales, so write '1' or '0'",
            S.ENV_FLAG_VALUES,
        )
    # Ray workers inherit the launching environment: a different value there changes TE's
    # scale rule behind the config's back.
    outer = os.environ.get(S.FP32_SCALES_ENV)
    if outer is not None and fp8_on and (outer == "1") != (str(env) == "1"):
        r.warn(
            S.FP32_SCALES_KEY,
            f"the current environment sets {S.FP32_SCALES_ENV}={outer!r}, which disagrees with "
            f"the config ({env!r}); workers that inherit it would use the other scale rule. "
            "Unset it or make the two agree",
        )
    # Rollout (vLLM).
    prec = r.choice(S.VLLM_PRECISION, S.VLLM_PRECISIONS, "bfloat16")
    kv = r.choice(S.VLLM_KV_DTYPE, S.VLLM_KV_DTYPES, "auto")
    if str(kv).startswith("fp8") and prec != "fp8":
        r.error(
            S.VLLM_KV_DTYPE,
            f"kv_cache_dtype={kv!r} needs {S.VLLM_PRECISION}=fp8 (NeMo-RL only supports an FP8 KV "
            f"cache together with FP8 weights); set precision to fp8 or kv_cache_dtype to auto",
        )
    for key in (S.VLLM_POW2_W, S.VLLM_POW2_A, S.VLLM_DEEP_GEMM):
        r.boolean(key, False)
    for key in (S.VLLM_FIRST_BF16, S.VLLM_LAST_BF16):
        r.count(key, 0)
    if r.boolean(S.VLLM_IS_MX, False) and prec != "fp8":
        r.error(S.VLLM_IS_MX, "is_mx=true needs precision=fp8")


def _check_loss_fn(r: _Reader) -> None:
    """NeMo-RL's ClippedPGLossConfig rules for importance-sampling correction."""
    from nemo_jetrl.rl.correction import loss_fn_issues  # the rules' one home (torch-free)

    section = r.get(S.LOSS_FN, None)
    if section is not None:
        for issue in loss_fn_issues(section, path=S.LOSS_FN):
            r.error(issue.key, issue.message, issue.allowed)


def _check_recipe_consistency(r: _Reader, recipe: Recipe) -> None:
    label = r.get("jetrl.recipe", None)
    if isinstance(label, str) and label in S.JETRL_KEYS["recipe"].choices:
        diffs = preset_differences(recipe, Recipe.preset(label))
        if diffs:
            r.warn(
                "jetrl.recipe",
                f"the keys describe a different recipe than {label!r}: "
                + "; ".join(diffs)
                + f" (run `jetrl align --recipe {label}` to write the preset's keys)",
            )
    if r.get("jetrl.onpolicy_kv", False) is True and not recipe.kv_fp8:
        r.error(
            "jetrl.onpolicy_kv",
            f"on-policy KV needs an FP8 KV cache: set {S.VLLM_KV_DTYPE}=fp8 (with "
            f"{S.VLLM_PRECISION}=fp8) or jetrl.onpolicy_kv=false",
        )
    if r.get("jetrl.vllm_patch", False) is True:
        if not recipe.rollout.fp8_linears:
            r.warn("jetrl.vllm_patch", f"has no effect unless {S.VLLM_PRECISION}=fp8")
        elif recipe.rollout.scaling != "blockwise":
            r.error(
                "jetrl.vllm_patch",
                f"the patch supplies blockwise FP8 only; set {S.VLLM_IS_MX}=false or "
                "jetrl.vllm_patch=false",
            )
    if recipe.train.fp8_linears and recipe.train.scaling != "blockwise":
        r.warn(
            S.FP8_RECIPE,
            f"{recipe.train.scaling!r} training FP8 never matches vLLM's blockwise rollout; "
            "nemo_jetrl's unified flow needs 'blockwise'",
            S.FP8_RECIPES,
        )


def _check_backend(r: _Reader) -> None:
    backend = r.get(S.GEN_BACKEND, "vllm")
    if backend not in ("vllm", "megatron"):
        r.warn(
            S.GEN_BACKEND,
            f"nemo_jetrl models vLLM and Megatron rollouts; with {backend!r} the check reads "
            "vllm_cfg, which may not describe that engine's quantization",
            ("vllm", "megatron"),
        )
    elif backend == "megatron" and r.get(S.VLLM_PRECISION, None) == "fp8":
        r.note(
            S.VLLM_PRECISION,
            "ignored: generation.backend=megatron samples with the training model",
        )


def _check_arch(r: _Reader, recipe: Recipe) -> None:
    """Check the recipe against the model: BF16 layer counts and 128-alignment of the linears."""
    arch, ok = _arch(r)
    if not ok:
        return
    if arch is None:
        from nemo_jetrl.arch import generic_arch

        check_layer_lists(r, recipe, generic_arch(256))  # Llama-shaped names, up to 256 layers
        r.note(
            S.MODEL_NAME,
            f"no built-in description of {r.get(S.MODEL_NAME, None)!r}; set jetrl.model_config "
            "to its config.json to check layer counts and 128-alignment",
        )
        return
    _check_bf16_layer_counts(r, recipe, arch.num_layers)
    _check_alignment(r, arch, recipe)
    check_layer_lists(r, recipe, arch)


def _check_bf16_layer_counts(r: _Reader, recipe: Recipe, n: int) -> None:
    """BF16 first/last layers must fit the model's ``n`` layers, leave one FP8 layer in training
    and fit one pipeline stage."""
    for key, first, last in (
        (
            "jetrl.train_num_first_layers_in_bf16",
            recipe.train.bf16_first_layers,
            recipe.train.bf16_last_layers,
        ),
        (S.VLLM_FIRST_BF16, recipe.rollout.bf16_first_layers, recipe.rollout.bf16_last_layers),
    ):
        if first + last > n:
            r.error(
                key, f"first ({first}) + last ({last}) BF16 layers exceed the model's {n} layers"
            )
    t = recipe.train
    if t.fp8_linears and t.bf16_first_layers + t.bf16_last_layers == n:
        r.error(
            "jetrl.train_num_first_layers_in_bf16",
            f"BF16 first ({t.bf16_first_layers}) + last ({t.bf16_last_layers}) layers cover all "
            f"{n} layers: no layer would run in FP8; lower them or set {S.FP8_ENABLED}=false",
        )
    pp = r.get("policy.megatron_cfg.pipeline_model_parallel_size", 1)
    if t.fp8_linears and isinstance(pp, int) and not isinstance(pp, bool) and pp >= 1:
        per_stage = n // pp
        for what, k in (("first", t.bf16_first_layers), ("last", t.bf16_last_layers)):
            if k > per_stage:
                r.error(
                    f"jetrl.train_num_{what}_layers_in_bf16",
                    f"{k} BF16 {what} layers exceed the {per_stage} layers of a pipeline stage "
                    "(Megatron allows at most num_layers // pipeline_model_parallel_size)",
                )


def _check_alignment(r: _Reader, arch: Any, recipe: Recipe) -> None:
    """Blockwise/MX FP8 needs 128-aligned linears: all unaligned is refused, some unaligned
    only with ``jetrl.unaligned_layers: bf16``."""
    blockwise = [
        s
        for s in (recipe.train, recipe.rollout)
        if s.fp8_linears and s.scaling in ("blockwise", "mxfp8")
    ]
    if not blockwise:
        return
    bad = arch.unaligned_linears()
    if len(bad) == len(arch.distinct_linears()):
        _no_fp8_coverage(r, arch, recipe, bad)
    elif bad and not recipe.unaligned_layers_bf16:
        names = ", ".join(f"{lin.name} {lin.out_features}x{lin.in_features}" for lin in bad[:6])
        more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
        key = S.FP8_ENABLED if recipe.train.fp8_linears else S.VLLM_PRECISION
        r.error(
            key,
            f"blockwise FP8 needs every linear's dims to be multiples of 128; {arch.name} has "
            f"{names}{more}. Set jetrl.unaligned_layers=bf16 to keep them BF16 on both sides, "
            "or turn FP8 off",
        )


def _no_fp8_coverage(r: _Reader, arch: Any, recipe: Recipe, bad: list) -> None:
    """A side that promises FP8 must run at least one linear in FP8: when no linear's shape
    allows it, the run would be all BF16 under an FP8 label (whatever unaligned_layers says)."""
    dims = ", ".join(f"{lin.kind} {lin.out_features}x{lin.in_features}" for lin in bad)
    for side, key in ((recipe.train, S.FP8_ENABLED), (recipe.rollout, S.VLLM_PRECISION)):
        if side.fp8_linears:
            r.error(
                key,
                f"promises FP8 but no linear of {arch.name} can be blockwise FP8 (both dims "
                f"must be multiples of 128; it has {dims}): every layer would run BF16 under the "
                f"FP8 recipe {recipe.name!r}. Turn FP8 off here (jetrl.unaligned_layers=bf16 "
                "does not help) or use a model whose hidden/intermediate sizes are multiples "
                "of 128",
            )


def validated(
    cfg: DictConfig, *, run: bool = False, sections: SectionProviders = NO_SECTIONS
) -> tuple[list[ConfigIssue], Recipe]:
    """Every issue in ``cfg`` and the Recipe it describes (meaningful only without errors).

    ``run``: the config is about to run here, so directories it writes must be writable on
    this machine (an error; for `jetrl check` a warning). ``sections``: the backends' hooks for
    their own ``jetrl.<name>`` sections (`nemo_jetrl.config.sections`)."""
    r = _Reader(cfg, sections)
    r.issues.extend(unresolvable(cfg))
    r.issues.extend(check_run_keys(cfg, run=run))
    _check_jetrl_section(r)
    _check_nemo_rl_keys(r)
    _check_loss_fn(r)
    _check_backend(r)
    try:
        recipe = read_recipe(r)
    except ValueError as exc:  # a Recipe invariant the checks above did not name
        r.error("jetrl", str(exc))
        recipe = Recipe()
    _check_recipe_consistency(r, recipe)
    _check_arch(r, recipe)
    seen: set[tuple[str, str]] = set()
    unique = []
    for i in r.issues:
        if (i.path, i.message) not in seen:
            seen.add((i.path, i.message))
            unique.append(i)
    return unique, recipe


def validate(cfg: DictConfig, sections: SectionProviders = NO_SECTIONS) -> list[ConfigIssue]:
    """Every problem in `cfg` (errors, warnings, notes), in the order found."""
    return validated(cfg, sections=sections)[0]


def errors(issues: Iterable[ConfigIssue]) -> list[ConfigIssue]:
    """Only the issues of level "error"."""
    return [i for i in issues if i.level == "error"]


def recipe_from_config(cfg: DictConfig, sections: SectionProviders = NO_SECTIONS) -> Recipe:
    """The Recipe a valid config describes; ConfigError listing every error otherwise."""
    issues, recipe = validated(cfg, sections=sections)
    if errors(issues):
        raise ConfigError(issues)
    return recipe
