"""Backend-owned config sections: ``jetrl.<name>`` is validated by the backend that reads it.

`nemo_jetrl.config` never imports a backend. Whoever validates a config for a backend (the
pipeline in `nemo_jetrl.flow.pipeline`, a backend's own setup) passes `SectionProviders`: for each
section name a function that returns that backend's `BackendSection`. It is called only when the
config has the section, so checking a cluster config never imports the local backend (or torch).
Without a provider the section is noted as not validated here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nemo_jetrl.config.load import ConfigIssue
from nemo_jetrl.config.settings import Settings


@dataclass(frozen=True)
class BackendSection:
    """The hooks a backend gives for its ``jetrl.<name>`` section."""

    validate: Callable[[Any, str], list[ConfigIssue]]
    """Every problem of the section itself (arguments: the section, its YAML path)."""

    validate_run: Callable[[Settings], list[ConfigIssue]]
    """Problems of the rest of the config that only this backend restricts (given the typed
    `Settings`, never the tree)."""

    model_config: Callable[[Any], str | None]
    """The config.json the backend builds its model from, given the section: what `jetrl check`
    checks the recipe against."""

    validate_with_run: Callable[[Any, Mapping[str, Any], Settings], list[ConfigIssue]] | None = None
    """Problems of the section and the NeMo-RL run keys together, which the backend's own door
    refuses too (the local backend's sequence lengths), given the section, the run keys as
    `nemo_jetrl.config.run_keys.read_run_keys` types them (``{field: value}``) and the
    `Settings`; None: there are none. Called when none of the keys it reads failed to parse
    (then it is named with their problems, not after them)."""

    with_run_reads: frozenset[str] = frozenset()
    """The run keys (`RUN_FIELDS` names) `validate_with_run` reads; empty: every run key."""


SectionProviders = Mapping[str, Callable[[], BackendSection]]
"""Section name (``"local"`` for ``jetrl.local``) -> a function returning its `BackendSection`."""

NO_SECTIONS: SectionProviders = {}
