"""Config -> Recipe -> verdict: the one pipeline every entry point runs.

`check_config(path_or_cfg, overrides)` loads and validates the config once (all errors at once,
as a `ConfigError`), builds its `Recipe` and model, and checks the precision flow; the result is
a `Checked`. `off_policy_refusal(checked)` is the ``jetrl.allow_off_policy`` gate. Users:
`jetrl check` and `jetrl align` (print it), `jetrl train` on every backend (refuse an off-policy
recipe unless allowed), and NeMo-RL preparation (`backends.nemo_rl.launch.prepare`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nemo_jetrl.arch import ModelArch, generic_arch
from nemo_jetrl.config import ConfigIssue, load_valid_config
from nemo_jetrl.flow.check import FlowCheck, check_on_policy, generic_layers_for
from nemo_jetrl.recipe import Recipe


@dataclass(frozen=True)
class Checked:
    """A loaded, validated config and its flow check (what `check` and `align` print)."""

    cfg: Any
    """The loaded config (omegaconf DictConfig, overrides applied)."""

    recipe: Recipe
    """The Recipe it describes."""

    arch: ModelArch
    """The model's ModelArch (a generic stand-in when the model is unknown)."""

    arch_note: str | None
    """Why a generic stand-in was used, or None."""

    issues: tuple[ConfigIssue, ...]
    """Warnings and notes from validation (errors never reach here)."""

    check: FlowCheck
    """The flow check: training forward vs rollout, edge by edge."""

    @property
    def allow_off_policy(self) -> bool:
        """``jetrl.allow_off_policy``: run a recipe this check finds off-policy."""
        jetrl = self.cfg.get("jetrl") or {}
        return bool(jetrl.get("allow_off_policy", False))


def check_config(
    cfg: str | os.PathLike[str] | Any, overrides: Sequence[str] = (), *, run: bool = False
) -> Checked:
    """Load ``cfg`` (a YAML path, or a loaded config), validate it, check its recipe on its model
    (generic aligned layers when the model is unknown). A `ConfigError` lists every error.
    ``run``: the config is about to train on this machine (its directories must be writable)."""
    from omegaconf import OmegaConf

    valid = load_valid_config(cfg, overrides, run=run)
    recipe, arch, note = valid.recipe, valid.arch, None
    if arch is None:
        n = generic_layers_for(recipe)
        arch = generic_arch(n)
        model = OmegaConf.select(valid.cfg, "policy.model_name", default=None)
        note = (
            f"model {model!r} has no built-in description: checked with {n} generic aligned "
            "layers (set jetrl.model_config to its config.json for exact layers and shapes)"
        )
    return Checked(valid.cfg, recipe, arch, note, valid.issues, check_on_policy(arch, recipe))


def off_policy_refusal(checked: Checked) -> str | None:
    """Why ``jetrl train`` refuses this config (off-policy, not allowed), or None to run it."""
    check = checked.check
    if check.on_policy or checked.allow_off_policy:
        return None
    lines = [
        f"  - {m.reason} ({m.summary()}); keys: {', '.join(m.keys) or '-'}"
        + (f"; fix: {' '.join(m.fixes)}" if m.fixes else "")
        for m in check.mismatches
    ]
    return (
        f"recipe {checked.recipe.name!r} is OFF-POLICY (the rollout's numbers differ from the "
        "training forward's):\n"
        + "\n".join(lines)
        + "\nChange those keys (`jetrl align CONFIG -o OUT.yaml` writes a config that fixes "
        "them), or set jetrl.allow_off_policy=true to run it anyway."
    )


def run_notes(checked: Checked) -> list[str]:
    """What ``jetrl train`` says before running a config that passed the gate."""
    notes = [checked.arch_note] if checked.arch_note else []
    if not checked.check.on_policy:
        notes.append(
            f"running off-policy recipe {checked.recipe.name!r} (jetrl.allow_off_policy=true)"
        )
    return notes
