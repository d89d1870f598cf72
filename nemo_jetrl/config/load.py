"""Loading NeMo-RL-shaped YAML: `defaults:` inheritance and Hydra-style overrides.

The rules are NeMo-RL's, so that its users' files work unchanged:

- ``defaults:`` names one parent file or a list of them, relative to the file that names them
  (absolute paths allowed). Parents load depth-first with their own defaults; later parents and
  then the child win. A mapping marked ``_override_: true`` replaces the parent's mapping instead
  of merging into it. ``${...}`` interpolations resolve against the merged result.
- Overrides are Hydra-style strings: ``a.b=value`` changes an existing key, ``+a.b=value`` adds a
  key that does not exist yet, ``++a.b=value`` sets it either way, ``~a.b`` deletes it. Values are
  parsed like Hydra's (YAML, but only ``true``/``false`` are booleans; ``'1'`` is a string).

Every problem becomes a `ConfigIssue`; `ConfigError` carries all of them at once.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from .merge import merge_parts

_MISSING = object()


@dataclass(frozen=True)
class ConfigIssue:
    """One problem found in a config."""

    path: str
    """Full dotted key path, e.g. "policy.generation.vllm_cfg.kv_cache_dtype"."""

    message: str
    """What is wrong and what to change, in plain words."""

    allowed: tuple[Any, ...] = ()
    """The values the key accepts, when it is an enumeration."""

    level: Literal["error", "warning", "note"] = "error"
    """Severity: "error" makes the config invalid; "warning" and "note" are advice."""

    def __str__(self) -> str:
        allowed = ""
        if self.allowed:
            allowed = " (allowed: " + ", ".join(_fmt(a) for a in self.allowed) + ")"
        return f"{self.path}: {self.message}{allowed}"


class ConfigError(ValueError):
    """A config with one or more errors; str() lists every one of them."""

    def __init__(self, issues: Sequence[ConfigIssue], source: str | None = None) -> None:
        self.issues = list(issues)
        self.source = source
        errors = [i for i in self.issues if i.level == "error"] or self.issues
        head = f"{len(errors)} problem{'s' if len(errors) != 1 else ''} in config"
        head += f" {source}" if source else ""
        # Notes say how the config was read (e.g. which model a placeholder name stands for).
        notes = [i for i in self.issues if i.level == "note" and i not in errors]
        super().__init__(
            head
            + ":\n"
            + "\n".join([*(f"  - {i}" for i in errors), *(f"  note: {i}" for i in notes)])
        )


def _fmt(v: Any) -> str:
    return "null" if v is None else str(v)


# ---------------------------------------------------------------------------------------------
# loading


# A file's config with its ``defaults:`` merged in, as plain containers, by resolved path. A walk
# over a NeMo-RL tree's examples (the NeMo-RL tier's config checks, scripts/nemo_rl_config_table.py,
# `jetrl check` then `jetrl align` in one process) reads the same few base files hundreds of times,
# and OmegaConf's merge copies the whole base at every level: the table's walk over v0.7.0 spent
# 129 of its 150 s loading (docs/ci_times.md). An entry keeps the bytes of every file it read and
# is used only while each file still holds them (read again: a few KB; a time stamp can miss an
# edit of the same size within one clock tick).
_INHERITED: dict[Path, tuple[dict[Path, bytes], dict]] = {}
_INHERITED_MAX = 4096  # entries (one per file): cleared when full


def _bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _inherited(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict[Path, bytes]]:
    """The file's config with its parents merged in (plain containers, the caller's own), and
    the bytes of every file read for it."""
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError([ConfigIssue("defaults", f"inheritance cycle: {cycle}")], str(path))
    if not path.is_file():
        what = "a directory, not a config file" if path.is_dir() else "config file not found"
        if chain:  # a parent named in defaults:
            issue = ConfigIssue("defaults", f"{what}: {path} (named in defaults: of {chain[-1]})")
        else:  # the file given itself
            issue = ConfigIssue("<file>", f"{what}: {path}")
        raise ConfigError([issue], str(path) if not chain else None)
    hit = _INHERITED.get(path)
    # a file of the chain among the entry's is a cycle, which the uncached path below names
    if hit is not None and all(p not in chain and _bytes(p) == b for p, b in hit[0].items()):
        return copy.deepcopy(hit[1]), hit[0]
    data = _bytes(path)
    cfg = OmegaConf.to_container(_parse_file(path, data), resolve=False)
    assert isinstance(cfg, dict)
    read = {path: data}
    if "defaults" in cfg:
        defaults = cfg.pop("defaults")
        if isinstance(defaults, (str, Path)):
            defaults = [defaults]
        elif isinstance(defaults, list):
            defaults = [str(d) for d in defaults]
        else:
            raise ConfigError(
                [ConfigIssue("defaults", "must be a file path or a list of file paths")], str(path)
            )
        parts = []
        for parent in defaults:
            ppath = Path(str(parent))
            ppath = ppath if ppath.is_absolute() else path.parent / ppath
            parent_cfg, parent_read = _inherited(ppath, (*chain, path))
            read.update(parent_read)
            parts.append(parent_cfg)
        cfg = merge_parts([*parts, cfg])
    if len(_INHERITED) >= _INHERITED_MAX:
        _INHERITED.clear()
    _INHERITED[path] = (read, copy.deepcopy(cfg))
    return cfg, read


def _parse_file(path: Path, data: bytes | None = None) -> DictConfig:
    """One YAML file (its bytes when already read) as a mapping: UTF-8 text, valid YAML, not
    empty (an empty file is a mistake, never a request for every default)."""
    try:
        text = (path.read_bytes() if data is None else data).decode("utf-8")
    except OSError as exc:
        raise ConfigError(
            [ConfigIssue("<file>", f"cannot read: {exc.strerror}")], str(path)
        ) from None
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start]
        msg = f"not UTF-8 text (byte {bad:#04x} at offset {exc.start}); save the file as UTF-8"
        raise ConfigError([ConfigIssue("<file>", msg)], str(path)) from None
    try:
        cfg = OmegaConf.create(text) if text.strip() else None
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        where = str(exc).replace('in "<unicode string>"', f"in {path.name}")  # the file's name
        raise ConfigError(
            [ConfigIssue("<file>", f"cannot parse YAML: {where}")], str(path)
        ) from None
    if cfg is None or (isinstance(cfg, DictConfig) and len(cfg) == 0):
        msg = "the file is empty (no keys); a config must describe a run"
        raise ConfigError([ConfigIssue("<file>", msg)], str(path))
    if not isinstance(cfg, DictConfig):
        raise ConfigError([ConfigIssue("<file>", "top level must be a mapping")], str(path))
    return cfg


def unresolvable(cfg: DictConfig) -> list[ConfigIssue]:
    """One issue per key whose ``${...}`` cannot be resolved (unknown key, unset environment
    variable, unregistered resolver), found by resolving every leaf, and per key whose *name*
    holds one (taken literally by OmegaConf: always a mistake)."""
    issues: list[ConfigIssue] = []

    def walk(node: Any, prefix: str) -> None:
        keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
        for key in keys:
            path = f"{prefix}{key}"
            if isinstance(key, str) and "${" in key:  # OmegaConf never resolves key names
                msg = "a key name cannot hold an interpolation; put ${...} in the value"
                issues.append(ConfigIssue(path, msg))
            try:
                val = node[key]
            except MissingMandatoryValue:
                issues.append(ConfigIssue(path, "mandatory value (???) is not set"))
                continue
            except OmegaConfBaseException as exc:
                raw = node._get_node(key)._value()  # type: ignore[union-attr]
                why = str(exc).splitlines()[0]
                issues.append(ConfigIssue(path, f"cannot resolve {raw!r}: {why}"))
                continue
            if isinstance(val, (DictConfig, ListConfig)):
                walk(val, f"{path}.")

    walk(cfg, "")
    return issues


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split one override into (op, key, value); op is "set", "add", "force" or "delete"."""
    s = text.strip()
    if s.startswith("~"):
        key, _, value = s[1:].partition("=")
        return "delete", key.strip(), (_parse_value(value) if value else _MISSING)
    op = "set"
    if s.startswith("++"):
        op, s = "force", s[2:]
    elif s.startswith("+"):
        op, s = "add", s[1:]
    key, eq, value = s.partition("=")
    if not eq or not key.strip():
        raise ValueError(f"override {text!r} is not key=value, +key=value, ++key=value or ~key")
    return op, key.strip(), _parse_value(value)


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


def merged_container(path: str | Path) -> dict:
    """The file's config with its ``defaults:`` merged in, as plain containers: interpolations
    unresolved, no overrides, nothing validated. A walk that skips most files (NeMo-RL's
    examples: a GRPO config has ``grpo`` and ``policy`` sections) reads them so, and builds the
    DictConfig of `load_config`, most of a load's time, only for those it keeps."""
    return _inherited(Path(path), ())[0]


def config_files(path: str | Path) -> list[Path]:
    """Every file a load of ``path`` reads: the file and its ``defaults:`` chain, resolved
    (symlinks followed). ConfigError as `load_config` raises it."""
    return list(_inherited(Path(path), ())[1])


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> DictConfig:
    """Load a NeMo-RL-shaped YAML with `defaults:` inheritance, then apply overrides.

    Raises ConfigError (never a bare YAML/OmegaConf traceback) for missing files, parse errors,
    inheritance cycles and bad overrides. Validation is separate: see `validate`. NeMo-RL's
    resolvers (``${mul:...}`` etc.) are registered first, as NeMo-RL's launchers do.
    """
    from nemo_jetrl.config.resolvers import register_resolvers

    register_resolvers()
    cfg, _ = _inherited(Path(path), ())
    return apply_overrides(OmegaConf.create(cfg), overrides)


def config_yaml(config: Any, *, recipe: str | None = None) -> str:
    """``config`` (a loaded config or a plain mapping) as YAML, with ``jetrl.recipe`` set from
    ``recipe`` when absent. Interpolations are written as given, not resolved, so a secret
    behind ``${oc.env:...}`` never reaches the text."""
    node = config if isinstance(config, DictConfig) else OmegaConf.create(dict(config))
    out = OmegaConf.to_container(node, resolve=False)  # never dict(cfg): it resolves leaves
    assert isinstance(out, dict)
    if recipe is not None:
        jet = out.setdefault("jetrl", {})
        if isinstance(jet, dict):
            jet.setdefault("recipe", recipe)
    return OmegaConf.to_yaml(OmegaConf.create(out))
