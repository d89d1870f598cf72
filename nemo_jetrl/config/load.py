"""Loading NeMo-RL-shaped YAML: `defaults:` inheritance, then Hydra-style overrides.

The rules are NeMo-RL's, so that its users' files work unchanged:

- ``defaults:`` names one parent file or a list of them, relative to the file that names them
  (absolute paths allowed). Parents load depth-first with their own defaults; later parents and
  then the child win. A mapping marked ``_override_: true`` replaces the parent's mapping instead
  of merging into it. ``${...}`` interpolations resolve against the merged result.
- Overrides (`nemo_jetrl.config.overrides`) are Hydra-style strings, applied after the load.

Every problem becomes a `ConfigIssue`; `ConfigError` carries all of them at once
(`nemo_jetrl.config.issues`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from .issues import ConfigError, ConfigIssue
from .merge import merge_parts
from .overrides import apply_overrides, override_syntax_issues

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
        parts, bad = [], []
        for parent in defaults:
            ppath = Path(str(parent))
            ppath = ppath if ppath.is_absolute() else path.parent / ppath
            try:
                parent_cfg, parent_read = _inherited(ppath, (*chain, path))
            except ConfigError as exc:  # every bad parent is named, not only the first
                bad.append(exc)
                continue
            read.update(parent_read)
            parts.append(parent_cfg)
        if bad:
            raise ConfigError([i for e in bad for i in e.issues], bad[0].source)
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
    try:
        cfg, _ = _inherited(Path(path), ())
    except ConfigError as exc:  # a malformed override is named with the file's problems
        raise ConfigError([*exc.issues, *override_syntax_issues(overrides)], exc.source) from None
    return apply_overrides(OmegaConf.create(cfg), overrides)


def value_as_given(path: str | Path, overrides: Sequence[str], key: str) -> Any:
    """The value of the dotted ``key`` in the config as given (file, ``defaults:``, overrides),
    unvalidated; None when absent or when the config cannot be read (its loader names why).
    For a command that adds an environment's problem to the config's own errors."""
    try:
        return OmegaConf.select(load_config(path, overrides), key, default=None)
    except Exception:  # unreadable YAML, a bad override, an unresolvable leaf: validated later
        return None


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
