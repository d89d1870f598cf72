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
from nemo_jetrl.config import (
    BackendSection,
    ConfigError,
    ConfigIssue,
    SectionProviders,
    Settings,
    load_valid_config,
)
from nemo_jetrl.config import schema as S
from nemo_jetrl.config.overrides import key_presence, setting_override
from nemo_jetrl.flow.backend import BackendVerdict, backend_verdicts
from nemo_jetrl.flow.check import FlowCheck, check_on_policy, generic_layers_for
from nemo_jetrl.flow.fixes import fix_text
from nemo_jetrl.flow.limits import VerdictLimit, verdict_limits
from nemo_jetrl.flow.support import state_space_model, unsupported_issues
from nemo_jetrl.recipe import Recipe


@dataclass(frozen=True)
class Checked:
    """A loaded, validated config and its flow check (what `check` and `align` print)."""

    cfg: Any
    """The loaded config tree (overrides applied): for what edits or runs the file itself
    (`jetrl align`, a backend's door); everything else reads `settings`."""

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

    settings: Settings
    """The typed keys read below the door (`nemo_jetrl.config.settings`), read once."""

    backends: tuple[BackendVerdict, ...] = ()
    """The verdict on each backend (`nemo_jetrl.flow.backend`)."""

    limits: tuple[VerdictLimit, ...] = ()
    """What the flow verdict cannot claim (`nemo_jetrl.flow.limits`): unmodelled precision
    keys, policy lag."""

    refused: tuple[ConfigIssue, ...] = ()
    """Errors for what no backend can run on-policy yet (`flow.support`), kept only when asked
    (``check_config(keep_refused=True)``, so `jetrl check` prints the flow before refusing)."""

    @property
    def precision_on_policy(self) -> bool:
        """The flow check passes and holds on every backend (precision only)."""
        return self.check.on_policy and all(b.on_policy for b in self.backends if b.runs)

    @property
    def on_policy(self) -> bool:
        """On-policy as far as this package can prove: precision, and nothing it cannot model
        and no policy lag."""
        return self.precision_on_policy and not self.limits

    def limits_of(self, kind: str) -> tuple[VerdictLimit, ...]:
        return tuple(x for x in self.limits if x.kind == kind)

    @property
    def allow_off_policy(self) -> bool:
        """``jetrl.allow_off_policy``: run a recipe this check finds off-policy."""
        return self.settings.allow_off_policy


def _local_section() -> BackendSection:
    from nemo_jetrl.backends.local.setup import SECTION

    return SECTION


BACKEND_SECTIONS: SectionProviders = {"local": _local_section}
"""The backends' own ``jetrl.<name>`` sections, loaded only when a config has them."""


def check_config(
    cfg: str | os.PathLike[str] | Any,
    overrides: Sequence[str] = (),
    *,
    run: bool = False,
    keep_refused: bool = False,
) -> Checked:
    """Load ``cfg`` (a YAML path, or a loaded config), validate it, check its recipe on its model
    (generic aligned layers when the model is unknown). A `ConfigError` lists every error.
    ``run``: the config is about to train on this machine (its directories must be writable).
    ``keep_refused``: return the `flow.support` refusals in `Checked.refused` instead of raising
    them (the caller must still refuse; `jetrl check` prints the flow first)."""
    valid = load_valid_config(cfg, overrides, run=run, sections=BACKEND_SECTIONS)
    recipe, arch, note, settings = valid.recipe, valid.arch, None, valid.settings
    refused = unsupported_issues(settings, recipe, arch)
    if refused and not keep_refused:
        notes = [i for i in valid.issues if i.level == "note"]  # how the model was read
        source = None if not isinstance(cfg, (str, os.PathLike)) else str(cfg)
        raise ConfigError([*refused, *notes], source)
    if arch is None:
        n = generic_layers_for(recipe)
        arch = generic_arch(n)
        given = setting_override(key_presence(valid.cfg), "jetrl.model_config", "PATH/config.json")
        note = (
            f"model {settings.model.name!r} has no built-in description: checked with {n} generic aligned "
            f"layers (for exact layers and shapes pass its config.json: {given})"
        )
        ssm = state_space_model(settings)
        if ssm is not None:  # BF16 on both sides here: FP8 was refused above
            note = (
                f"model with state-space layers ({ssm[1]}), which nemo_jetrl does not describe: "
                f"checked with {n} generic aligned layers (BF16 on both sides: nothing to align)"
            )
    issues = valid.issues
    unread = arch.layout_not_compared()
    if unread and (recipe.train.fp8_linears or recipe.rollout.fp8_linears or recipe.kv_fp8):
        key = "jetrl.model_config" if settings.model.config else S.MODEL_NAME
        issues = (*issues, ConfigIssue(key, unread, (), "warning"))
    check = check_on_policy(arch, recipe)
    backends = backend_verdicts(settings, check, arch)
    return Checked(
        valid.cfg,
        recipe,
        arch,
        note,
        issues,
        check,
        settings,
        backends,
        verdict_limits(settings),
        tuple(refused),
    )


def off_policy_refusal(checked: Checked, backend: str | None = None) -> str | None:
    """Why ``jetrl train`` refuses this config (off-policy, not allowed), or None to run it.

    ``backend`` ("nemo-rl"): also refuse what is off-policy only there (`flow.backend`);
    "local": the local verdict decides (its HF rollout runs what vLLM's MLA decode keeps BF16)."""
    check = checked.check
    if checked.allow_off_policy:
        return None
    # the override pastes as printed: `+key` where the config has no such key (no `jetrl:`)
    allow = setting_override(key_presence(checked.cfg), "jetrl.allow_off_policy", "true")
    unmodelled = checked.limits_of("unmodelled")
    if unmodelled:
        return (
            f"{unmodelled[0].message}. Remove {', '.join(unmodelled[0].keys)} or pass "
            f"{allow} to run it anyway."
        )
    lag = checked.limits_of("policy_lag")
    if lag:  # jetrl check says OFF-POLICY (exit 1) for it: the gate follows that verdict
        return f"{lag[0].message}. Or pass {allow} to run it anyway."
    if backend == "local" and not check.on_policy:
        local = next((b for b in checked.backends if b.backend == "local"), None)
        if local is not None and local.on_policy:
            return None
    if check.on_policy:
        off = [b for b in checked.backends if backend and b.backend.startswith(backend)]
        off = [b for b in off if not b.on_policy]
        if not off:
            return None
        return (
            f"recipe {checked.recipe.name!r} is OFF-POLICY on {off[0].backend}: {off[0].reason}"
            f"; or pass {allow} to run it anyway."
        )
    lines = [
        f"  - {m.reason} ({m.summary()}); keys: {', '.join(m.keys) or '-'}"
        + (f"; fix: {fix_text(key_presence(checked.cfg), m.fixes)}" if m.fixes else "")
        for m in check.mismatches
    ]
    return (
        f"recipe {checked.recipe.name!r} is OFF-POLICY (the rollout's numbers differ from the "
        "training forward's):\n"
        + "\n".join(lines)
        + "\nChange those keys (`jetrl align CONFIG -o OUT.yaml` writes a config that fixes "
        f"them), or pass {allow} to run it anyway."
    )


def run_notes(checked: Checked) -> list[str]:
    """What ``jetrl train`` says before running a config that passed the gate."""
    notes = [checked.arch_note] if checked.arch_note else []
    notes += [f"warning: {i}" for i in checked.issues if i.level == "warning"]
    notes += [f"off-policy by policy lag: {x.message}" for x in checked.limits_of("policy_lag")]
    if not checked.check.on_policy:
        notes.append(
            f"running off-policy recipe {checked.recipe.name!r} (jetrl.allow_off_policy=true)"
        )
    return notes
