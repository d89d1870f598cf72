"""A resubmitted job continues its own recipe, or does not start.

NeMo-RL resumes from the newest ``step_N`` under ``checkpointing.checkpoint_dir`` whenever one is
there (``CheckpointManager.get_latest_checkpoint_path``) and reads only its
``training_info.json``. A resubmission whose YAML or overrides changed the recipe (BF16 to FP8,
power-of-two to FP32 scales, on-policy KV on or off) would continue another recipe's weights and
optimizer state, and its logs would join the old run's in ``jetrl compare``, without a word.
Each checkpoint also holds the run's master config (``config.yaml``), our recipe among the
policy workers' env vars, and ``policy.model_name`` / ``policy.tokenizer.name``: compared here,
before Ray starts, as the local backend does with its own checkpoints (another model's
checkpoint failed after Ray and model load, or trained on silently where the shapes match).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STEP_DIR = re.compile(r"step_(\d+)")
"""NeMo-RL's finished checkpoint directories (``tmp_step_N`` is one being written)."""


def latest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The ``step_N`` NeMo-RL would resume from (the highest N), or None."""
    if not checkpoint_dir.is_dir():
        return None
    steps = [
        (int(m.group(1)), p) for p in checkpoint_dir.iterdir() if (m := STEP_DIR.fullmatch(p.name))
    ]
    return max(steps)[1] if steps else None


def _policy_env(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """A master config's ``policy.megatron_cfg.env_vars``, where the translation puts the recipe."""
    return ((cfg.get("policy") or {}).get("megatron_cfg") or {}).get("env_vars") or {}


def _other_model(saved: Mapping[str, Any], merged: Mapping[str, Any]) -> str | None:
    """What of ``policy.model_name`` / ``policy.tokenizer.name`` differs between a checkpoint's
    master config and this launch's (None: neither). Names compare as written, trailing "/" aside:
    a model moved to another path reads as another model."""

    def names(cfg: Mapping[str, Any]) -> tuple[str, str]:
        policy = cfg.get("policy") or {}
        model = str(policy.get("model_name") or "").rstrip("/")
        tok = str((policy.get("tokenizer") or {}).get("name") or model).rstrip("/")
        return model, tok

    (m0, t0), (m1, t1) = names(saved), names(merged)
    diffs = [
        f"{key} {a!r} (this config: {b!r})"
        for key, a, b in (("policy.model_name", m0, m1), ("policy.tokenizer.name", t0, t1))
        if a and a != b
    ]
    return ", ".join(diffs) or None


def resume_problem(merged: Mapping[str, Any]) -> str | None:
    """Why this launch must not resume the checkpoint NeMo-RL would pick (None: it may, or
    there is none). ``merged``: the translated master config, paths already absolute."""
    import yaml

    from nemo_jetrl.backends.nemo_rl.policy_env import RECIPE_ENV, recipe_from_json
    from nemo_jetrl.recipe import preset_differences

    # NeMo-RL resumes whatever checkpointing.enabled says (grpo.setup asks its CheckpointManager
    # for the latest step either way, v0.7.0 grpo.py :319); enabled only decides saving
    ckpt = merged.get("checkpointing") or {}
    if not ckpt.get("checkpoint_dir"):
        return None
    latest = latest_checkpoint(Path(str(ckpt["checkpoint_dir"])))
    if latest is None or not (latest / "config.yaml").is_file():
        return None
    fix = (
        "resubmit with the config that run used, or point checkpointing.checkpoint_dir at a new "
        "directory to start this one from its step 0"
    )
    try:
        saved = yaml.safe_load((latest / "config.yaml").read_text()) or {}
        text = _policy_env(saved).get(RECIPE_ENV)
        theirs = recipe_from_json(text) if text else None
    except (OSError, ValueError, yaml.YAMLError) as exc:
        return f"checkpointing.checkpoint_dir: {latest}/config.yaml cannot be read ({exc}); {fix}"
    ours = recipe_from_json(_policy_env(merged)[RECIPE_ENV])
    other = _other_model(saved, merged)
    if other:  # the weights themselves: refused first, whatever the recipes say
        return (
            f"checkpointing.checkpoint_dir: NeMo-RL would resume {latest}, written for {other}: "
            f"it would load that model's weights (another shape fails after Ray and model "
            f"load; the same shapes train on silently); {fix}"
        )
    if theirs is None:
        return (
            f"checkpointing.checkpoint_dir: NeMo-RL would resume {latest}, written without "
            f"nemo_jetrl (its config.yaml has no {RECIPE_ENV}), as recipe {ours.name!r}: {fix}"
        )
    # what changes the numbers (name, KV calibration settings, the training quantizer's
    # implementation and DeepGEMM do not: an OOM fix to kv_calibration.micro_batch_size resumes)
    changed = [d.split(":")[0] for d in preset_differences(ours, theirs)]
    if not changed:
        return None
    return (
        f"checkpointing.checkpoint_dir: NeMo-RL would resume {latest}, written by recipe "
        f"{theirs.name!r}, under this config's {ours.name!r} (differs in {', '.join(changed)}): "
        f"the run would go on from another recipe's weights and optimizer state; {fix}"
    )
