"""What a local run's weights, numbers and data mean: recorded in every checkpoint
(``state.pt``'s `IDENTITY_KEY`) and compared with the config on ``--resume`` before any work
(`identity_issues`, called by `loop.run_local` before the warm start, the models or the engine).

Resumed under another model config the checkpoint's weights ran under another architecture
(a rope_theta x10 took the reward from 0.19 to 0); under another ``grpo.seed`` the validation set
and the warm start (the KL reference policy) were another run's while config.yaml said the new
seed, all without a word. So each key in `REFUSED` must be the checkpoint's (exit 2, one issue a
key); a change of a key in `NOTED` resumes with a note; hyperparameters (optimizer, loss, batch
sizes, temperature, ``max_new_tokens``) are not recorded: a resubmission may change them
(`resume.apply_optimizer_settings` names the optimizer's). The recipe has its own comparison
(`resume.recipe_issue`). Checkpoints written before the record existed resume with a note.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nemo_jetrl.backends.local.config import LocalSettings, RunSettings
from nemo_jetrl.backends.local.model import load_model_config
from nemo_jetrl.backends.local.tokenizer import tokenizer_file
from nemo_jetrl.config.load import ConfigIssue

IDENTITY_KEY = "run_identity"  # the entry of a checkpoint's state.pt

#: Keys whose change on ``--resume`` is refused, with what the checkpoint's value determines.
REFUSED: dict[str, str] = {
    "grpo.seed": "it seeds the model init, the warm start (with a KL penalty, the reference "
    "policy) and the validation set",
    "jetrl.local.model_config": "the checkpoint's weights were trained under that architecture",
    "jetrl.local.tokenizer": "its token ids are what the checkpoint's weights read and write",
    "jetrl.local.dtype": "the BF16 parts of both sides compute in it",
    "jetrl.local.batch_invariant": "it decides whether rollout and trainer agree bit for bit",
    "jetrl.local.val_greedy": "it decides what validation accuracy measures",
    "jetrl.local.task": "it makes the problems, their reward and the validation set",
    "jetrl.local.warmstart": "it makes the starting weights (with a KL penalty, the reference "
    "policy)",
}

#: Keys a resumed run takes from its config, with a note when they changed.
NOTED: dict[str, str] = {
    "jetrl.local.rollout_engine": "the resumed steps sample on another engine",
    "jetrl.local.device": "the resumed steps compute on another device",
}

# Fields of a model config that say where and with which library version it was read, not what
# the model is. Every other field is compared, also one only one side holds: a transformers
# upgrade that renames fields is refused like a change (its model may compute otherwise).
_NOT_THE_MODEL = ("transformers_version", "_name_or_path")

ABSENT = "<absent>"  # a model config field only one side holds

_REMEDY = (
    "Resume with the config that wrote the checkpoint (the run's config.yaml), or point "
    "logger.log_dir / checkpointing.checkpoint_dir at a new run"
)


def model_config_content(config: Any) -> dict[str, Any]:
    """A transformers config's content as JSON data (``to_dict`` serialised as the warm-start
    cache key serialises it: the same text, so one definition of "the same model config")."""
    return json.loads(json.dumps(config.to_dict(), sort_keys=True, default=str))


def tokenizer_digest(tokenizer_json: str) -> str:
    """sha256 of a tokenizers JSON file's text (the warm-start cache key's tokenizer entry)."""
    return hashlib.sha256(tokenizer_json.encode()).hexdigest()


def tokenizer_path(local: LocalSettings) -> Path:
    """The tokenizers JSON file a run loads (``jetrl.local.tokenizer``, else the repo's)."""
    return tokenizer_file(local.tokenizer)


def run_identity(run: RunSettings, local: LocalSettings) -> dict[str, Any]:
    """The `REFUSED` and `NOTED` keys' values of a run (reads the model config and tokenizer
    files, nothing else): what a checkpoint records and a resume is compared with."""
    ws = local.warmstart
    return {
        "grpo.seed": run.seed,
        "jetrl.local.model_config": model_config_content(load_model_config(local.model_config)),
        "jetrl.local.tokenizer": tokenizer_digest(tokenizer_path(local).read_text()),
        "jetrl.local.dtype": local.dtype,
        "jetrl.local.batch_invariant": local.batch_invariant,
        "jetrl.local.val_greedy": local.val_greedy,
        "jetrl.local.task": asdict(local.task),
        # None: no warm start (its other settings then make no weights, so they may change)
        "jetrl.local.warmstart": asdict(ws) if ws.enabled and ws.steps > 0 else None,
        "jetrl.local.rollout_engine": local.rollout_engine,
        "jetrl.local.device": local.device,
    }


def identity_issues(
    state: dict[str, Any], current: dict[str, Any], path: Path
) -> tuple[list[ConfigIssue], list[str]]:
    """(one `ConfigIssue` per `REFUSED` key whose value in checkpoint ``path`` (its ``state``)
    differs from ``current``'s (`run_identity` of this config), notes): a changed `NOTED` key,
    and the keys the checkpoint does not record (written before they were), not compared."""
    recorded = state.get(IDENTITY_KEY)
    recorded = recorded if isinstance(recorded, dict) else {}
    issues: list[ConfigIssue] = []
    notes: list[str] = []
    for key, now in current.items():
        if key not in recorded:
            continue
        was = recorded[key]
        if key in NOTED and was != now:
            notes.append(
                f"{key} {was!r} in checkpoint {path}, {now!r} in this config: the config's "
                f"applies ({NOTED[key]}: not bit-identical to an uninterrupted run)"
            )
        elif key in REFUSED:
            why = f"{REFUSED[key]}: the resumed steps would not continue the run that wrote it"
            issues.extend(
                ConfigIssue(k, f"{what}; {why}. {_REMEDY}")
                for k, what in _changes(key, was, now, path)
            )
    missing = [k for k in current if k not in recorded]
    if missing:
        notes.append(
            f"checkpoint {path} was written before checkpoints recorded {', '.join(missing)}: "
            "not compared with this config (a change of them goes unnoticed)"
        )
    return issues, notes


def _changes(key: str, was: Any, now: Any, path: Path) -> list[tuple[str, str]]:
    """(key, what changed) for one recorded key: a model config is one change listing its
    fields, a section (task, warm start) one change per field, anything else its two values."""
    where = f"in checkpoint {path}"
    if key == "jetrl.local.model_config":
        fields = [
            f
            for f in _field_diffs(was, now, union=True)
            if f[0].split(".")[0] not in _NOT_THE_MODEL
        ]
        if not fields:
            return []
        listed = "; ".join(f"{f} {_show(a)} -> {_show(b)}" for f, a, b in fields)
        return [(key, f"another model config than the one {where} (its -> this: {listed})")]
    if key == "jetrl.local.tokenizer":
        digests = f"sha256 {str(was)[:12]}... {where}, {str(now)[:12]}... in this config"
        return [] if was == now else [(key, f"a tokenizer of other content ({digests})")]
    if isinstance(was, dict) and isinstance(now, dict):
        diffs = _field_diffs(was, now)
        return [(f"{key}.{f}", f"{a!r} {where}, {b!r} in this config") for f, a, b in diffs]
    if key == "jetrl.local.warmstart" and (was is None) != (now is None):
        steps = f"a warm start of {(now or was or {}).get('steps')} steps"
        none = "no warm start (enabled: false or steps: 0)"
        return [(key, f"{steps if was else none} {where}, {steps if now else none} in this config")]
    return [] if was == now else [(key, f"{was!r} {where}, {now!r} in this config")]


def _field_diffs(a: dict[str, Any], b: dict[str, Any], *, union: bool = False) -> list[tuple]:
    """(dotted field, value in ``a``, value in ``b``) for each field that differs, nested mappings
    field by field. ``union``: a field only one side holds differs too (shown as `ABSENT`; a
    model config that gained ``rope_scaling``); else it is not compared (a section's field this
    code added after the checkpoint was written)."""
    out = []
    keys = set(a) | set(b) if union else set(a) & set(b)
    for k in sorted(keys):
        x, y = a.get(k, ABSENT), b.get(k, ABSENT)
        if isinstance(x, dict) and isinstance(y, dict):
            out.extend((f"{k}.{f}", u, v) for f, u, v in _field_diffs(x, y, union=union))
        elif x != y:
            out.append((k, x, y))
    return out


def _show(v: Any) -> str:
    return v if v is ABSENT else repr(v)
