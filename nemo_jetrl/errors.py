"""Errors the user sees: what went wrong and what to change. Imports nothing of the package.

`UserError` is printed by the ``jetrl`` console script without a traceback (exit code 2);
`MissingDependencyError` names the optional dependency and how to install it
(`nemo_jetrl._optional.require` raises it). `cwd_hint`: where a relative path was looked for;
`together`: several problems as one error.
"""

from __future__ import annotations

from pathlib import Path


class UserError(Exception):
    """A problem with the user's input: printed without a traceback, exit code 2."""


class MissingDependencyError(ImportError):
    """An optional dependency is not installed; the message says how to get it."""


def cwd_hint(path: str | Path) -> str:
    """For a relative ``path`` not found: where it was looked for (a config's paths, like
    NeMo-RL's, are read from the working directory, not from the YAML file's); else ""."""
    p = Path(path).expanduser()
    return "" if p.is_absolute() else f" (relative to the working directory {Path.cwd()})"


def together(problems: list[str], done: str = "nothing run") -> UserError:
    """One `UserError` for every problem found (one alone as it is; several listed, a problem
    of several lines indented under its dash); ``done``: what was left undone."""
    if len(problems) == 1:
        return UserError(problems[0])
    items = ["  - " + p.replace("\n", "\n    ") for p in problems]
    return UserError(f"{len(problems)} problems, {done}:\n" + "\n".join(items))
