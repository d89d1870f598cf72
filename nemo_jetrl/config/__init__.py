"""NeMo-RL-shaped configs: the public entry points.

- `load_config(path, overrides)`: YAML with NeMo-RL's ``defaults:`` inheritance and Hydra-style
  overrides (`nemo_jetrl.config.load`).
- `validate(cfg)` -> every `ConfigIssue`; `recipe_from_config(cfg)` -> `Recipe` or a
  `ConfigError` listing all errors (`nemo_jetrl.config.validate`, reading through
  `nemo_jetrl.config.reader`); `arch_from_config(cfg)` -> the model's `ModelArch` or None.
- `load_valid_config(path_or_cfg, overrides)`: all of the above in one call for commands and
  backends -> `ValidConfig` (config, recipe, architecture, warnings, and the typed `Settings`
  the modules below the door read: `nemo_jetrl.config.settings`) or a `ConfigError`.
- `recipe_to_config_updates(recipe)`: the NeMo-RL and ``jetrl:`` keys expressing a recipe (the
  inverse mapping, used by `jetrl align`); `minimal_updates` keeps only what changes;
  `merge_updates` applies them.

Modules: `load` (YAML, overrides, `ConfigIssue`), `typed` (the one typed schema layer: every
key's rule, strict, "got X; expected Y"), `nemo_rl_model` / `jetrl_model` (the sections),
`reader` (values, the Recipe), `schema` (key paths, allowed values), `validate` (every issue at
once: the typed parse, then rules across keys; config -> Recipe), `updates` (Recipe -> keys).
Key names and meanings: `nemo_jetrl.config.schema`, `jetrl_model` and docs/configs.md.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from omegaconf import DictConfig

from nemo_jetrl.config.issues import ConfigError, ConfigIssue
from nemo_jetrl.config.load import load_config
from nemo_jetrl.config.overrides import apply_overrides, override_syntax_issues, parse_override
from nemo_jetrl.config.reader import arch_from_config
from nemo_jetrl.config.sections import NO_SECTIONS, BackendSection, SectionProviders
from nemo_jetrl.config.settings import Settings, settings_of
from nemo_jetrl.config.updates import (
    merge_updates,
    minimal_updates,
    nemo_rl_setup_updates,
    recipe_to_config_updates,
    vllm_cfg_for,
)
from nemo_jetrl.config.validate import errors, recipe_from_config, validate, validated
from nemo_jetrl.recipe import Recipe, preset_differences

__all__ = [
    "NO_SECTIONS",
    "BackendSection",
    "ConfigError",
    "ConfigIssue",
    "SectionProviders",
    "Settings",
    "ValidConfig",
    "apply_overrides",
    "arch_from_config",
    "errors",
    "load_config",
    "load_valid_config",
    "merge_updates",
    "minimal_updates",
    "nemo_rl_setup_updates",
    "parse_override",
    "preset_differences",
    "recipe_from_config",
    "recipe_to_config_updates",
    "settings_of",
    "validate",
    "vllm_cfg_for",
]


@dataclass(frozen=True)
class ValidConfig:
    """A loaded config without errors, with what commands and backends need from it."""

    cfg: DictConfig
    """The config, defaults resolved and overrides applied."""

    recipe: Recipe
    """The precision recipe its keys describe."""

    arch: Any
    """The model's architecture (jetrl.model_config or a built-in), None for an unknown model."""

    issues: tuple[ConfigIssue, ...]
    """Every issue `validate` found (warnings and notes only: errors raise)."""

    settings: Settings
    """The typed keys the modules below the door read (`nemo_jetrl.config.settings`)."""


def load_valid_config(
    cfg: str | os.PathLike[str] | DictConfig,
    overrides: Sequence[str] = (),
    *,
    run: bool = False,
    sections: SectionProviders = NO_SECTIONS,
) -> ValidConfig:
    """Load ``cfg`` (a YAML path, or a loaded config to apply ``overrides`` to), validate it and
    build its recipe and architecture; a `ConfigError` lists every error: the bad overrides'
    and the config's own together (a bad override never hides the file's problems). ``run``:
    it is about to run on this machine (see `validated`); ``sections``: the backends' hooks for
    their own sections (`nemo_jetrl.config.sections`). The one validation `check`, `align`
    and `train` (every backend) go through."""
    from nemo_jetrl.config.resolvers import register_resolvers

    register_resolvers()
    if isinstance(cfg, DictConfig):
        conf, source = cfg, None
    else:
        try:
            conf, source = load_config(cfg), str(cfg)
        except ConfigError as exc:  # the overrides' syntax is named with the file's problems
            raise ConfigError(
                [*exc.issues, *override_syntax_issues(overrides)], exc.source
            ) from None
    bad_overrides: list[ConfigIssue] = []
    try:
        apply_overrides(conf, list(overrides))  # good overrides apply even when some fail
    except ConfigError as exc:
        bad_overrides = exc.issues
    issues, recipe = validated(conf, run=run, sections=sections)
    issues = bad_overrides + _name_overrides(issues, overrides)
    if errors(issues):
        raise ConfigError(issues, source)
    arch = arch_from_config(conf, sections)
    return ValidConfig(conf, recipe, arch, tuple(issues), settings_of(conf))


def _name_overrides(issues: list[ConfigIssue], overrides: Sequence[str]) -> list[ConfigIssue]:
    """Say which command-line override set a key that has a problem."""
    by_key: dict[str, str] = {}
    for text in overrides:
        try:
            by_key[parse_override(text)[1]] = text
        except ValueError:
            continue
    return [
        replace(i, message=f"{i.message} (set by override {by_key[i.path]!r})")
        if i.path in by_key
        else i
        for i in issues
    ]
