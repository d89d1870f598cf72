"""Merging a config file's ``defaults:`` parents into it, by NeMo-RL's rules.

Parents come first in order, then the file itself; a later part wins. Mappings merge key by key,
anything else replaces, ``???`` (missing) never replaces a value, and a mapping marked
``_override_: true`` replaces the parent's mapping instead of merging into it.

The merge runs on plain dicts and lists: building a DictConfig per file and merging with
OmegaConf was most of a tree walk's time (docs/ci_times.md). Where OmegaConf's merge does
something a key-by-key merge cannot, OmegaConf's own merge gives the result.
"""

from __future__ import annotations

import copy
from typing import Any

from omegaconf import DictConfig, OmegaConf

_MISSING = object()


def merge_with_override(base: DictConfig | None, child: DictConfig) -> DictConfig:
    """Merge `child` into `base` (None: nothing yet) with OmegaConf; mappings marked
    ``_override_: true`` replace instead of merge. Both are the loader's own: `base` changes in
    place (OmegaConf.merge copies the whole base at every level) and `child` may become the
    result. `merge_parts` does the same on plain containers where it can."""
    for key in list(child.keys()):
        if OmegaConf.is_missing(child, key):
            continue
        val = child._get_node(key)
        if isinstance(val, DictConfig) and val.get("_override_", False):
            val.pop("_override_")
            if base is not None and key in base:
                base.pop(key)
    if base is None:  # merging into an empty mapping would copy `child` as it is
        return child
    base.merge_with(child)
    return base


class _NotPlain(Exception):
    """A merge whose result only OmegaConf's own merge gives (see `merge_parts`)."""


def _interpolation(v: Any) -> bool:
    return isinstance(v, str) and "${" in v


def _merge_into(base: dict, child: dict) -> None:
    """OmegaConf's merge of one mapping into another, on plain containers: mappings merge key by
    key, anything else replaces, and ``???`` (missing) never replaces a value. Where OmegaConf
    does something else it raises `_NotPlain`: a mapping merged into an interpolation (OmegaConf
    resolves it and merges into the result) or a list meeting a mapping (OmegaConf refuses)."""
    for key, val in child.items():
        old = base.get(key, _MISSING)
        if val == "???" and old is not _MISSING:
            continue
        if isinstance(val, dict):
            if isinstance(old, dict):
                _merge_into(old, val)
                continue
            if isinstance(old, list) or _interpolation(old):
                raise _NotPlain(key)
        elif isinstance(val, list) and isinstance(old, dict):
            raise _NotPlain(key)
        base[key] = val


def merge_parts(parts: list[dict]) -> dict:
    """`parts` (parents in order, then the file itself) merged as `merge_with_override` merges
    them, on plain containers that become the result; OmegaConf's merge where `_merge_into`
    cannot follow it. Building a DictConfig per file and merging with OmegaConf was most of a
    tree walk's time (the NeMo-RL config table: docs/ci_times.md)."""
    originals = copy.deepcopy(parts)  # the attempt below changes them before it may give up
    try:
        base: dict | None = None
        for part in parts:
            for key, val in part.items():
                if isinstance(val, dict) and "_override_" in val:
                    flag = val["_override_"]
                    if _interpolation(flag):
                        raise _NotPlain(key)
                    if flag:
                        del val["_override_"]
                        if base is not None:
                            base.pop(key, None)
            if base is None:
                base = part
            else:
                _merge_into(base, part)
        assert base is not None
        return base
    except _NotPlain:
        merged: DictConfig | None = None
        for part in originals:
            merged = merge_with_override(merged, OmegaConf.create(part))
        return OmegaConf.to_container(merged, resolve=False)  # type: ignore[return-value]
