"""A config's problems: `ConfigIssue` (one problem, its dotted key and what to change) and
`ConfigError` (every problem at once). The loader, the overrides and the validator all speak
these."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal


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
