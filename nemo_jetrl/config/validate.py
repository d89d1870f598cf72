"""Validation of a loaded config: every problem, reported together.

`validate` never stops at the first problem: it parses the whole config with the typed schema
(`nemo_jetrl.config.typed`: NeMo-RL's sections in `nemo_rl_model`, ours in `jetrl_model`),
then applies the rules across keys: NeMo-RL's precision keys, NeMo-RL's importance-sampling
rules for ``loss_fn`` (its ClippedPGLossConfig checks), the recipe's internal consistency, and, when the model is
known, the architecture (layer counts, 128-alignment for blockwise FP8). Each finding is a
`ConfigIssue` with the full key path, a message saying what to change, and the allowed values.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import DictConfig

from nemo_jetrl.config import schema as S
from nemo_jetrl.config.layer_lists import ROLLOUT_KEY, TRAIN_KEY, bf16_words_for, check_layer_lists
from nemo_jetrl.config.load import ConfigError, ConfigIssue, unresolvable
from nemo_jetrl.config.reader import _arch, _Reader, arch_from_config, read_recipe
from nemo_jetrl.config.run_keys import RUN_FIELDS, check_run_keys, failed_fields, read_run_keys
from nemo_jetrl.config.sections import NO_SECTIONS, SectionProviders
from nemo_jetrl.config.settings import settings_of
from nemo_jetrl.fp8.spec import BLOCK, linear_dims_problem
from nemo_jetrl.recipe import PRESET_NAMES, Recipe, preset_differences

__all__ = ["arch_from_config", "errors", "recipe_from_config", "validate"]


def _check_jetrl_section(r: _Reader) -> None:
    """Rules across ``jetrl.*`` keys and the backends' own sections (each key's type and values:
    the typed parse, `nemo_jetrl.config.jetrl_model`)."""
    section = r.get("jetrl", None)
    if not isinstance(section, Mapping):
        return
    cal = section.get("kv_calibration")
    if isinstance(cal, Mapping):
        pct, reduction = cal.get("percentile"), cal.get("reduction")
        if reduction == "max" and pct is not None and pct != 100.0:
            r.warn(
                "jetrl.kv_calibration.percentile",
                f"ignored: reduction is max (the percentile {pct} applies only with "
                "reduction: percentile)",
            )
    local = section.get("local")
    if isinstance(local, Mapping):
        _check_local(r)


def _check_local(r: _Reader) -> None:
    section = r.section("local")
    if section is None:
        r.note(
            "jetrl.local",
            "not validated here (no local-backend schema was given; `jetrl check`, `align` and "
            "`train` validate it)",
        )
        return
    r.issues.extend(section.validate(r.cfg.jetrl.local, "jetrl.local"))
    # NeMo-RL keys only that backend restricts, read through the typed settings
    settings = settings_of(r.cfg)
    r.issues.extend(section.validate_run(settings))
    if section.validate_with_run is not None:  # the section with the typed run keys
        keys = read_run_keys(r.cfg, [])  # a run key's own problem is `check_run_keys`' to name
        if not failed_fields(r.cfg, keys) & (section.with_run_reads or RUN_FIELDS.keys()):
            r.issues.extend(section.validate_with_run(r.cfg.jetrl.local, keys, settings))


def _check_nemo_rl_keys(r: _Reader) -> None:
    """Rules across NeMo-RL's precision keys (each key's own type and values: the typed parse,
    `nemo_jetrl.config.nemo_rl_model`)."""
    # Training FP8 (Megatron/TE).
    fp8_on = r.get(S.FP8_ENABLED, False) is True
    if fp8_on:
        for key, choices in ((S.FP8_FORMAT, S.FP8_FORMATS), (S.FP8_RECIPE, S.FP8_RECIPES)):
            v = r.get(key, None)
            if not r.has(key):
                r.error(key, "required when fp8_cfg.enabled is true (NeMo-RL reads it)", choices)
            elif v not in choices:
                msg = f"got {v!r}; expected one of the allowed values (fp8_cfg.enabled is true)"
                r.error(key, msg, choices)
        if r.get(S.MEGATRON_ENABLED, None) is False:
            r.warn(
                S.FP8_ENABLED,
                "NeMo-RL applies fp8_cfg only with the Megatron backend "
                f"({S.MEGATRON_ENABLED}=false here); the local backend honours it",
            )
    env = r.get(S.FP32_SCALES_KEY, None)
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
    prec = r.get(S.VLLM_PRECISION, "bfloat16")
    kv = r.get(S.VLLM_KV_DTYPE, "auto")
    if str(kv).startswith("fp8") and prec != "fp8":
        r.error(
            S.VLLM_KV_DTYPE,
            f"kv_cache_dtype={kv!r} needs {S.VLLM_PRECISION}=fp8 (NeMo-RL only supports an FP8 KV "
            f"cache together with FP8 weights); set precision to fp8 or kv_cache_dtype to auto",
        )
    if r.get(S.VLLM_IS_MX, False) is True and prec != "fp8":
        r.error(S.VLLM_IS_MX, "is_mx=true needs precision=fp8")


def _check_loss_fn(r: _Reader) -> None:
    """NeMo-RL's ClippedPGLossConfig rules for importance-sampling correction."""
    from nemo_jetrl.rl.correction import loss_fn_issues  # the rules' one home (torch-free)

    section = r.get(S.LOSS_FN, None)
    if section is not None:
        for issue in loss_fn_issues(section, path=S.LOSS_FN):
            r.error(issue.key, issue.message, issue.allowed)


def _check_patch_activation_scales(r: _Reader) -> None:
    """Our patch quantizes the rollout's activations with the weights' scale rule; NeMo-RL's
    key turns on its own activation patch of the same vLLM function (v0.7.0: crashes vLLM
    start-up, nemo_rl/models/generation/vllm/quantization/fp8.py:143)."""
    patch = r.get("jetrl.vllm_patch", False) is True
    if (
        patch
        and r.get(S.VLLM_PRECISION, "bfloat16") == "fp8"
        and r.get(S.VLLM_POW2_A, False) is True
    ):
        r.error(
            S.VLLM_POW2_A,
            "must be false with jetrl.vllm_patch=true: our patch quantizes the rollout's "
            f"activations with the rule of {S.VLLM_POW2_W}; true would also turn on NeMo-RL's "
            "own activation patch of the same vLLM function (and crashes vLLM start-up on "
            "NeMo-RL v0.7.0)",
        )


def _check_recipe_consistency(r: _Reader, recipe: Recipe) -> None:
    label = r.get("jetrl.recipe", None)
    if isinstance(label, str) and label in PRESET_NAMES:
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
        from nemo_jetrl.arch.builtins import model_dir_config
        from nemo_jetrl.arch.state_space import name_is_state_space

        check_layer_lists(r, recipe, generic_arch(256))  # Llama-shaped names, up to 256 layers
        name = r.get(S.MODEL_NAME, None)
        read = r.get("jetrl.model_config", None) or model_dir_config(name)
        if read or name_is_state_space(name):  # a config.json read, or a name: state-space
            return  # noted by the check's stand-in (`flow.pipeline`) or refused (`flow.support`)
        r.note(
            S.MODEL_NAME,
            ("not given" if name is None else f"no built-in description of {name!r}")
            + "; set jetrl.model_config to its config.json to check layer counts and "
            "128-alignment",
        )
        return
    from nemo_jetrl.arch.builtins import placeholder_note

    placeholder = None if r.get("jetrl.model_config", None) else r.get(S.MODEL_NAME, None)
    note = placeholder_note(placeholder)
    if note:
        r.note(S.MODEL_NAME, note)
    _check_bf16_layer_counts(r, recipe, arch.num_layers)
    if arch.mamba is None:  # FP8 on Nemotron-H is refused whole (`flow.support`): no align hint
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
    """Linears blockwise/MX FP8 cannot run (`Linear.fits`: blockwise takes partial 128-blocks
    under TE's dims rule; experts and MXFP8 need multiples of 128), and partial-block linears
    vLLM's tensor parallelism splits off a block edge (`Linear.vllm_tp_problem`): all unfit is
    refused, some only with ``jetrl.unaligned_layers: bf16``."""
    blockwise = [
        s
        for s in (recipe.train, recipe.rollout)
        if s.fp8_linears and s.scaling in ("blockwise", "mxfp8")
    ]
    if not blockwise:
        return
    tp = r.get(_VLLM_TP, 1) if recipe.rollout.fp8_linears else 1
    tp = tp if isinstance(tp, int) and not isinstance(tp, bool) else 1
    why: dict[str, str] = {}
    for x in arch.distinct_linears():
        # A linear that every FP8 side keeps BF16 by name (per-name lists) needs no tiling.
        sides = [s for s in blockwise if not s.keeps_bf16(x.name)]
        if any(not x.fits(s.scaling) for s in sides):
            unfit = [s.scaling for s in sides if not x.fits(s.scaling)]
            why[x.name] = _unfit_words(x, unfit[0])
        elif recipe.rollout in sides and (split := x.vllm_tp_problem(tp)):
            why[x.name] = split
    bad = [x for x in arch.distinct_linears() if x.name in why]
    if len(bad) == len(arch.distinct_linears()):
        _no_fp8_coverage(r, arch, recipe, bad)
    elif bad and not recipe.unaligned_layers_bf16:
        names = "; ".join(
            f"{lin.name} {lin.out_features}x{lin.in_features}: {why[lin.name]}" for lin in bad[:6]
        )
        more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
        key = S.FP8_ENABLED if recipe.train.fp8_linears else S.VLLM_PRECISION
        r.error(
            key,
            f"blockwise FP8 cannot run every linear of {arch.name} ({names}{more}). "
            f"{_unaligned_fix(r, arch, bad)}",
        )


_VLLM_TP = S.VLLM_TP


def _unfit_words(x: Any, scaling: str) -> str:
    if scaling == "blockwise" and x.group != "experts":
        return linear_dims_problem(x.in_features, x.out_features) or ""
    what = "MXFP8" if scaling == "mxfp8" else "fused experts"
    return f"{what} needs both dims to be multiples of {BLOCK}"


def _unaligned_fix(r: _Reader, arch: Any, bad: list) -> str:
    """What keeps those linears BF16 where this config runs: the local backend honours
    jetrl.unaligned_layers (its FP8 conversion skips them on both sides); NeMo-RL reads only
    the per-name lists (vLLM's ignored layers, our Megatron worker's training list)."""
    if isinstance(r.get("jetrl.local", None), Mapping):
        return "Set jetrl.unaligned_layers=bf16 to keep them BF16 on both sides, or turn FP8 off"
    dense = [x for x in bad if x.group != "experts"]
    words = bf16_words_for(arch, list(dict.fromkeys(x.kind for x in dense)))
    experts = (
        "; no per-name word keeps routed experts BF16 in Megatron (our worker matches decoder "
        "linears only): use a model whose expert sizes are multiples of 128"
        if len(dense) < len(bad)
        else ""
    )
    named = f"add {words} to both {ROLLOUT_KEY} and {TRAIN_KEY}, or " if words else ""
    return (
        f"Run `jetrl align` (it keeps such linears BF16 on both sides by name), or {named}turn "
        f"FP8 off (jetrl.unaligned_layers is read by the local backend only){experts}"
    )


def _no_fp8_coverage(r: _Reader, arch: Any, recipe: Recipe, bad: list) -> None:
    """A side that promises FP8 must run at least one linear in FP8: when no linear's shape
    allows it, the run would be all BF16 under an FP8 label (whatever unaligned_layers says)."""
    dims = ", ".join(f"{lin.kind} {lin.out_features}x{lin.in_features}" for lin in bad)
    for side, key in ((recipe.train, S.FP8_ENABLED), (recipe.rollout, S.VLLM_PRECISION)):
        if side.fp8_linears:
            r.error(
                key,
                f"promises FP8 but no linear of {arch.name} can be blockwise FP8 (TE's FP8 dims "
                f"rule, in % 16 and out % 8; it has {dims}): every layer would run BF16 under the "
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
    _check_patch_activation_scales(r)
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
