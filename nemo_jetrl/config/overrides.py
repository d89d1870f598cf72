"""Hydra-style overrides, as NeMo-RL's launchers take them: ``a.b=value`` changes an existing
key, ``+a.b=value`` adds one, ``++a.b=value`` sets it either way, ``~a.b`` deletes it; values
are parsed like Hydra's (YAML, but only ``true``/``false`` are booleans). A mapping value
merges into the section it names. Every bad override is a `ConfigIssue`, all reported together.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .issues import ConfigError, ConfigIssue

_MISSING = object()


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split one override into (op, key, value); op is "set", "add", "force" or "delete"."""
    s = text.strip()
    if s.startswith("~"):
        key, _, value = s[1:].partition("=")
        _check_key(text, key.strip())
        return "delete", key.strip(), (_parse_value(value) if value else _MISSING)
    op = "set"
    if s.startswith("++"):
        op, s = "force", s[2:]
    elif s.startswith("+"):
        op, s = "add", s[1:]
    key, eq, value = s.partition("=")
    if not eq or not key.strip():
        raise ValueError(f"override {text!r} is not key=value, +key=value, ++key=value or ~key")
    _check_key(text, key.strip())
    return op, key.strip(), _parse_value(value)


def _check_key(text: str, key: str) -> None:
    # `policy..x` or `.x` would address a key named "" (OmegaConf writes one; NeMo-RL never reads it)
    if any(not part.strip() for part in key.split(".")):
        raise ValueError(f"override {text!r}: key {key!r} has an empty part between dots")


def _parse_value(value: str) -> Any:
    """Parse like Hydra: YAML values, but only true/false are booleans (`yes`/`on` stay
    strings); `${...}` interpolations are kept as text."""
    if value.strip() == "":
        return ""
    if value.strip().lower() in ("yes", "no", "on", "off", "y", "n"):
        return value.strip()
    try:
        node = OmegaConf.create("v: " + value)
    except (yaml.YAMLError, OmegaConfBaseException):
        return value
    return OmegaConf.to_container(node, resolve=False)["v"]  # type: ignore[index]


def apply_overrides(cfg: DictConfig, overrides: Iterable[str]) -> DictConfig:
    """Apply Hydra-style overrides in order; every bad override is reported together."""
    issues: list[ConfigIssue] = []
    for text in overrides:
        try:
            op, key, value = parse_override(text)
        except ValueError as exc:
            issues.append(ConfigIssue("<override>", str(exc)))
            continue
        if "${" in key:
            msg = f"override {text!r}: a key name cannot hold an interpolation; put it in the value"
            issues.append(ConfigIssue(key, msg))
            continue
        exists = _exists(cfg, key)
        if op == "delete":
            if not exists:
                issues.append(ConfigIssue(key, f"override {text!r}: cannot delete, key not set"))
                continue
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            node.pop(leaf)
            continue
        if op == "set" and not exists:
            near = _near_keys(cfg, key)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            issues.append(
                ConfigIssue(
                    key,
                    f"override {text!r}: key not in config; use +{key}=... to add it{hint}",
                )
            )
            continue
        if op == "add" and exists:
            issues.append(
                ConfigIssue(key, f"override {text!r}: key already set; use {key}=... to change it")
            )
            continue
        problem = _mapping_value_problem(cfg, op, key, value)
        if problem:
            issues.append(ConfigIssue(key, f"override {text!r}: {problem}"))
            continue
        # a mapping merges into the mapping it names, as Hydra (NeMo-RL's overrides) does;
        # anything else replaces (a list for a section: the validator names the key)
        node = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
        merge = isinstance(value, dict) and isinstance(node, DictConfig)
        try:
            OmegaConf.update(cfg, key, value, merge=merge, force_add=True)
        except OmegaConfBaseException as exc:
            issues.append(ConfigIssue(key, f"override {text!r} failed: {exc}"))
    if issues:
        raise ConfigError(issues, "overrides")
    return cfg


def key_presence(cfg: DictConfig) -> Callable[[str], bool]:
    """Whether ``cfg`` has a dotted key: what `setting_override` asks (the flow's fixes take
    this, not the tree)."""
    return lambda key: _exists(cfg, key)


def setting_override(has_key: Callable[[str], bool], key: str, value: str) -> str:
    """The override `apply_overrides` accepts for setting ``key`` to ``value`` (its text) in a
    config whose `key_presence` is ``has_key``: ``key=value`` when it has the key,
    ``+key=value`` when it does not."""
    return f"{'' if has_key(key) else '+'}{key}={value}"


def _mapping_value_problem(cfg: DictConfig, op: str, key: str, value: Any) -> str | None:
    """Why a mapping value cannot be merged into ``key``: a YAML key such as ``a:1`` (no space
    after the colon: Hydra reads ``{a:1}`` as a: 1, YAML as a key "a:1"), or, for ``key=``, a
    key a section it merges into lacks (Hydra refuses it too; ``+``/``++`` add it). A null
    or scalar in the config is replaced whole."""
    if not isinstance(value, dict):
        return None
    stack = [(key, value)]
    while stack:
        where, node = stack.pop()
        for k, v in node.items():
            if isinstance(k, str) and ":" in k and v is None:
                a, _, b = k.partition(":")
                return f"write {{{a}: {b}}} with a space after the colon (read as a key {k!r})"
            into = OmegaConf.select(cfg, where, throw_on_resolution_failure=False)
            if op == "set" and isinstance(into, DictConfig) and not _exists(cfg, f"{where}.{k}"):
                return f"{where}.{k} is not in config; use +{where}.{k}=... to add it"
            if isinstance(v, dict):
                stack.append((f"{where}.{k}", v))
    return None


def _exists(cfg: DictConfig, key: str) -> bool:
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node._get_node(part)
    return True


def _near_keys(cfg: DictConfig, key: str) -> list[str]:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
    if not isinstance(node, DictConfig):
        return []
    prefix = f"{parent}." if parent else ""
    return [prefix + k for k in difflib.get_close_matches(leaf, [str(k) for k in node], n=3)]


def override_syntax_issues(overrides: Iterable[str]) -> list[ConfigIssue]:
    """The overrides' problems that need no config: their syntax."""
    issues = []
    for text in overrides:
        try:
            parse_override(text)
        except ValueError as exc:
            issues.append(ConfigIssue("<override>", str(exc)))
    return issues
