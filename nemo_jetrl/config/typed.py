"""The one typed schema layer every config key check goes through (pydantic v2, strict).

A key's rule is a type plus what is allowed, in words (`rule`, and the shorthands below); a
section is a model: `NemoSection` for NeMo-RL's sections (keys we do not read pass, so we are
never stricter than NeMo-RL on them) and `OurSection` for ``jetrl.*`` (an unknown key is an
error with a close-match suggestion). Strict means no string -> bool/number coercion, and no
bool counts as a number; floats must be finite. `parse` turns every failure of a mapping into a
`ConfigIssue` with its full key path and our wording, "got X; expected Y", all at once. Checks
across several keys are plain functions run after the parse (`nemo_jetrl.config.validate`).
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from nemo_jetrl.config.load import ConfigIssue

M = TypeVar("M", bound=BaseModel)
_ERROR = "jetrl"


def _fail(value: Any, what: str, allowed: Sequence[Any] = ()) -> PydanticCustomError:
    ctx = {"got": repr(value), "what": what, "allowed": tuple(allowed)}
    return PydanticCustomError(_ERROR, "got {got}; expected {what}", ctx)


def _expecting(
    what: str, allowed: Sequence[Any] = (), ok: Callable[[Any], bool] | None = None
) -> WrapValidator:
    """Replace pydantic's message with ours; ``ok``: an extra check on a well-typed value."""

    def check(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            out = handler(value)
        except ValidationError:
            raise _fail(value, what, allowed) from None
        if ok is not None and out is not None and not ok(out):
            raise _fail(value, what, allowed)
        return out

    return WrapValidator(check)


def rule(
    tp: Any,
    what: str,
    *constraints: Any,
    allowed: Sequence[Any] = (),
    ok: Callable[[Any], bool] | None = None,
) -> Any:
    """The annotated type of one key: ``tp`` under ``constraints`` (pydantic/annotated_types
    metadata), ``ok`` (a check no constraint expresses) and the words ``what`` for errors."""
    return Annotated[(tp, *constraints, _expecting(what, allowed, ok))]  # 3.10: no *-subscript


def _nullable(what: str, null: bool) -> str:
    """``what`` for a key that may be null: ", or null" added unless ``what`` already says
    what null means there ("..., or null to disable dual clipping")."""
    return f"{what}, or null" if null and "null" not in what else what


def flag(null: bool = False) -> Any:
    return rule(bool | None if null else bool, _nullable("true or false", null))


def count(lo: int = 0, hi: int | None = None, null: bool = False) -> Any:
    what = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
    return rule(int | None if null else int, _nullable(what, null), Field(ge=lo, le=hi))


def number(what: str, *constraints: Any, null: bool = False) -> Any:
    """A finite number (an integer is accepted and read as a float)."""
    return rule(float | None if null else float, _nullable(what, null), *constraints)


def choice(*values: Any, what: str = "one of the allowed values") -> Any:
    """One of ``values``; the issue lists them (`ConfigIssue.allowed`) after ``what``."""
    return rule(Literal[values], what, allowed=values)  # type: ignore[valid-type]


def text(what: str = "a string", null: bool = False, non_empty: bool = False) -> Any:
    ok = bool if non_empty else None
    return rule(str | None if null else str, _nullable(what, null), ok=ok)


def words(what: str = "a list of non-empty strings", null: bool = True) -> Any:
    tp = list[Annotated[str, Field(min_length=1)]]
    return rule(tp | None if null else tp, _nullable(what, null))


def _mapping(null: bool) -> WrapValidator:
    def check(value: Any, handler: Callable[[Any], Any]) -> Any:
        if value is None and null:
            return None
        if not isinstance(value, Mapping):
            raise _fail(value, "a mapping (a section of keys)")
        return handler(value)

    return WrapValidator(check)


def section(model: type[BaseModel], null: bool = True) -> Any:
    """A nested section: a mapping (or, with ``null``, null: absent); a list or a scalar is an
    error naming it."""
    return Annotated[model | None, _mapping(null)]


def any_section(null: bool = True) -> Any:
    """A section whose keys we do not read: only its shape (a mapping) is checked."""
    return Annotated[dict[str, Any] | None, _mapping(null)]


class NemoSection(BaseModel):
    """A section NeMo-RL owns: the keys we read are typed, every other key passes."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True, allow_inf_nan=False)


class OurSection(BaseModel):
    """A section of ours: every key is known; an unknown one is an error."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


def _model_of(tp: Any) -> type[BaseModel] | None:
    """The model class inside an annotation (``Annotated[Model | None, ...]`` -> Model)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    origin = typing.get_origin(tp)
    if origin is Annotated or origin is typing.Union or origin is types.UnionType:
        for arg in typing.get_args(tp):
            found = _model_of(arg)
            if found is not None:
                return found
    return None


def _keys(model: type[BaseModel]) -> dict[str, str]:
    """YAML key -> field name (a field may be spelled by its alias)."""
    return {(f.alias or name): name for name, f in model.model_fields.items()}


def _model_at(model: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    for part in loc:
        fld = model.model_fields.get(_keys(model).get(str(part), str(part)))
        found = _model_of(fld.annotation) if fld is not None else None
        if found is None:
            return None
        model = found
    return model


def _issue(model: type[BaseModel], err: Mapping[str, Any], prefix: str) -> ConfigIssue:
    loc = [str(p) for p in err["loc"]]
    path = ".".join([prefix, *loc] if prefix else loc) or "<file>"
    ctx = err.get("ctx") or {}
    if err["type"] == _ERROR:
        return ConfigIssue(path, err["msg"], tuple(ctx.get("allowed", ())))
    if err["type"] == "extra_forbidden":
        owner = _model_at(model, loc[:-1])
        known = list(_keys(owner)) if owner is not None else []
        near = difflib.get_close_matches(loc[-1], known, n=1)
        base = path.rpartition(".")[0]
        hint = f"; did you mean {base}.{near[0]}?" if near else ""
        return ConfigIssue(path, f"unknown key{hint}", tuple(known))
    if err["type"] in ("model_type", "dict_type", "model_attributes_type"):
        return ConfigIssue(path, f"got {err['input']!r}; expected a mapping (a section of keys)")
    return ConfigIssue(path, f"got {err.get('input')!r}; {err['msg']}")


def _typos(a: str, b: str) -> int:
    """Edits from ``a`` to ``b`` (a letter added, dropped, changed, or two swapped), up to 3."""
    if abs(len(a) - len(b)) > 2:
        return 3
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            d = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                d = min(d, prev2[j - 2] + 1)
            row.append(d)
        prev2, prev = prev, row
    return min(prev[-1], 3)


def near_misses(model: type[BaseModel], data: Any, prefix: str = "") -> list[ConfigIssue]:
    """Keys of ``data`` (a config's mapping, read by ``model``) that no section of ours knows
    (NeMo-RL's other keys pass) but are a typo away from a key we read (one edit for a name of 5
    letters or fewer, else two): the value is then silently not the one read
    (``grpo.max_num_step=2`` ran 16 steps). Warnings (`run_keys` makes them errors where a run
    starts); values are not looked at. No such key is in any GRPO config of ours or of NeMo-RL
    v0.7.0 or main (tests/config/test_key_typos.py)."""
    if not isinstance(data, Mapping):
        return []
    out: list[ConfigIssue] = []
    keys = _keys(model)
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if str(key) in keys:
            child = _model_of(model.model_fields[keys[str(key)]].annotation)
            if child is not None:
                out += near_misses(child, value, path)
            continue
        near = [k for k in keys if _typos(str(key), k) <= (1 if len(k) <= 5 else 2)]
        if near and model.model_config.get("extra") == "allow":  # ours: "unknown key" already
            where = f"{prefix}.{near[0]}" if prefix else near[0]
            out.append(
                ConfigIssue(
                    path,
                    f"unknown key, one typo from {where}, which is read (this value is not): "
                    f"did you mean {where}?",
                    level="warning",
                )
            )
    return out


def parse(model: type[M], data: Any, prefix: str = "") -> tuple[M | None, list[ConfigIssue]]:
    """``data`` read by ``model``: (the model, []) or (None, every issue with its key path)."""
    try:
        return model.model_validate(data), []
    except ValidationError as exc:
        return None, [_issue(model, e, prefix) for e in exc.errors()]


def parse_rest(model: type[M], data: Any, prefix: str = "") -> tuple[M | None, list[ConfigIssue]]:
    """`parse`, and when some keys fail, the model of the other keys (for the checks that read
    them, so that every problem is reported at once); None when ``data`` is no mapping."""
    parsed, issues = parse(model, data, prefix)
    if parsed is not None or not issues or not isinstance(data, Mapping):
        return parsed, issues
    bad = {str(e["loc"][0]) for e in _errors(model, data) if e["loc"]}
    rest, _ = parse(model, {k: v for k, v in data.items() if str(k) not in bad}, prefix)
    return rest, issues


def parse_leaves(model: type[M], data: Any, prefix: str = "") -> tuple[M | None, list[ConfigIssue]]:
    """`parse_rest` at the finest grain: each failing key is left out where it lies (a nested
    key alone, not its whole section), so that the rules across keys read every key that
    parsed; where that still fails to parse, `parse_rest`'s sections."""
    parsed, issues = parse(model, data, prefix)
    if parsed is not None or not issues or not isinstance(data, Mapping):
        return parsed, issues
    rest = _copy(data)
    for err in _errors(model, data):
        _drop(rest, err["loc"])
    parsed, _ = parse(model, rest, prefix)
    return (parsed if parsed is not None else parse_rest(model, data, prefix)[0]), issues


def _copy(data: Mapping[Any, Any]) -> dict[Any, Any]:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def _drop(data: dict[Any, Any], loc: Sequence[Any]) -> None:
    """Remove the deepest mapping key along ``loc`` (a list item or a union's branch in ``loc``
    takes its whole key with it)."""
    node, last = data, None
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            break
        last = (node, part)
        node = node[part]
    if last is not None:
        del last[0][last[1]]


def _errors(model: type[BaseModel], data: Any) -> list[Any]:
    try:
        model.model_validate(data)
    except ValidationError as exc:
        return list(exc.errors())
    return []


def plain(node: Any) -> Any:
    """A config as plain Python with interpolations resolved; a key that cannot be resolved is
    left out (`nemo_jetrl.config.load.unresolvable` names it)."""
    if isinstance(node, DictConfig):
        out: dict[str, Any] = {}
        for key in node:
            try:
                val = node[key]
            except OmegaConfBaseException:
                continue
            out[str(key)] = plain(val)
        return out
    if isinstance(node, ListConfig):
        items = []
        for i in range(len(node)):
            try:
                items.append(plain(node[i]))
            except OmegaConfBaseException:
                continue
        return items
    return node
