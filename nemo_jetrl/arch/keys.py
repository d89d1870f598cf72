"""Reading a config.json's keys with every problem collected, then reported together.

Each family reads its own keys through one `Keys`; a bad value becomes a phrase naming the key
and what to change, and `Keys.raise_if_any` raises one `ArchError` listing them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_jetrl.arch.linear import ArchError

_MISSING = object()


class Keys:
    """The keys of one config.json (or its ``text_config``), with the problems found so far."""

    def __init__(self, config: Mapping[str, Any], label: str) -> None:
        self.config = config
        self.label = label
        self.problems: list[str] = []

    def has(self, key: str) -> bool:
        return self.config.get(key) is not None

    def int(self, key: str, default: Any = _MISSING, minimum: int = 1) -> int:
        """An integer >= ``minimum``; a problem (and ``minimum``) when absent or bad."""
        v = self.config.get(key)
        if v is None:
            if default is not _MISSING:
                return default
            self.problems.append(f"{key} is missing")
            return max(minimum, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            self.problems.append(f"{key}={v!r}: expected an integer >= {minimum}")
            return max(minimum, 1)
        return v

    def int_list(self, key: str, bound: int) -> tuple[int, ...]:
        """A list of layer indices in [0, bound)."""
        v = self.config.get(key)
        if v is None:
            return ()
        if not isinstance(v, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in v
        ):
            self.problems.append(f"{key}={v!r}: expected a list of layer indices")
            return ()
        bad = [x for x in v if not 0 <= x < bound]
        if bad:
            self.problems.append(
                f"{key} has {bad}, outside the model's layers 0..{bound - 1} "
                f"(num_hidden_layers={bound})"
            )
        return tuple(x for x in v if 0 <= x < bound)

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def raise_if_any(self) -> None:
        if self.problems:
            raise ArchError(f"config of {self.label!r}: " + "; ".join(self.problems))
