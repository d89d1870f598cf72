"""The NeMo-RL run keys a backend reads (``grpo.*``, ``policy.optimizer.kwargs.*``, sampling,
checkpointing, the log directory), the rules for the directories a run writes into, and what
kind of config it is: a GRPO run, not another NeMo-RL program's config (`program_issues`).

Their rules live once, typed, in `nemo_jetrl.config.nemo_rl_model`: the config validator
(`jetrl check`, `align`, `train` on every backend) parses the whole config through it in
`check_run_keys`, and the local backend reads its `RunSettings` through `read_run_keys` (the
same parse, plus the rules across keys below). `path_problem` is the rule for directories.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_jetrl.config.jetrl_model import LOCAL_MODEL_NAME
from nemo_jetrl.config.load import ConfigIssue
from nemo_jetrl.config.nemo_rl_model import (
    ABSENT,
    MAX_RESPONSES_PER_STEP,
    RUN_SECTIONS,
    RunConfig,
    value_at,
)
from nemo_jetrl.config.typed import near_misses, parse, parse_leaves, plain

# `RunSettings` field -> the NeMo-RL key it reads.
RUN_FIELDS: dict[str, str] = {
    "num_prompts_per_step": "grpo.num_prompts_per_step",
    "num_generations_per_prompt": "grpo.num_generations_per_prompt",
    "max_num_steps": "grpo.max_num_steps",
    "val_period": "grpo.val_period",
    "val_at_start": "grpo.val_at_start",
    "seed": "grpo.seed",
    "normalize_rewards": "grpo.normalize_rewards",
    "use_leave_one_out_baseline": "grpo.use_leave_one_out_baseline",
    "temperature": "policy.generation.temperature",
    "max_new_tokens": "policy.generation.max_new_tokens",
    "max_total_sequence_length": "policy.max_total_sequence_length",
    "lr": "policy.optimizer.kwargs.lr",
    "weight_decay": "policy.optimizer.kwargs.weight_decay",
    "betas": "policy.optimizer.kwargs.betas",
    "eps": "policy.optimizer.kwargs.eps",
    "max_grad_norm": "policy.max_grad_norm",
    "train_global_batch_size": "policy.train_global_batch_size",
    "checkpoint_enabled": "checkpointing.enabled",
    "checkpoint_dir": "checkpointing.checkpoint_dir",
    "save_period": "checkpointing.save_period",
    "keep_top_k": "checkpointing.keep_top_k",
    "log_dir": "logger.log_dir",
}
# Keys read as given even when null (null means "off" / "the default" to their readers).
_NULL_MEANS_OFF = (
    "max_new_tokens",
    "max_total_sequence_length",
    "max_grad_norm",
    "checkpoint_dir",
    "keep_top_k",
)


def _select(cfg: DictConfig, key: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, default=None)
    except OmegaConfBaseException:
        return None  # unresolvable or under a non-mapping: the typed parse names it


def parse_run_config(cfg: DictConfig) -> tuple[RunConfig | None, list[ConfigIssue]]:
    """The whole config read by the typed schema: (model, []) or (None, every issue)."""
    return parse(RunConfig, plain(cfg))


def _across_keys(out: dict[str, Any], issues: list[ConfigIssue]) -> None:
    n, g = out.get("num_prompts_per_step"), out.get("num_generations_per_prompt")
    if n is not None and g is not None and n * g > MAX_RESPONSES_PER_STEP:
        issues.append(
            ConfigIssue(
                "grpo.num_prompts_per_step",
                f"{n} prompts x {g} generations = {n * g} responses per step exceeds "
                f"{MAX_RESPONSES_PER_STEP}; lower num_prompts_per_step or "
                "num_generations_per_prompt",
            )
        )


def read_run_keys(cfg: DictConfig, issues: list[ConfigIssue]) -> dict[str, Any]:
    """``{field: value}`` of every run key the config sets that parses; every problem goes to
    ``issues`` (the rules across keys read the keys that parsed, so they are named with the
    keys' own problems). A caller that runs needs ``issues`` empty; `failed_fields` names the
    fields left out for a problem of their own."""
    model, found = parse_leaves(RunConfig, plain(cfg))
    issues.extend(found)
    if model is None:
        return {}
    out: dict[str, Any] = {}
    for name, key in RUN_FIELDS.items():
        val = value_at(model, key)
        if val is ABSENT or (val is None and name not in _NULL_MEANS_OFF):
            continue
        out[name] = tuple(val) if name == "betas" else val
    if out.get("val_period", 0) < 0:
        out["val_period"] = 0  # NeMo-RL's "never" (val_period <= 0)
    _across_keys(out, issues)
    return out


def failed_fields(cfg: DictConfig, keys: Mapping[str, Any]) -> frozenset[str]:
    """The `RUN_FIELDS` the config gives that `read_run_keys` left out of ``keys`` (their value
    did not parse): a rule reading one of them would read a default the user did not give."""
    return frozenset(
        name for name, key in RUN_FIELDS.items() if name not in keys and _given(cfg, key)
    )


def _given(cfg: DictConfig, key: str) -> bool:
    """Whether the config sets ``key`` to something: a value that cannot be resolved
    (``${nope}``) is given, and failed."""
    try:
        return OmegaConf.select(cfg, key, default=None) is not None
    except OmegaConfBaseException:
        return True


def path_problem(path: str | os.PathLike[str]) -> tuple[str, bool] | None:
    """Why a run cannot create and write directory ``path``: (message, fatal) or None.

    fatal: no machine can fix it (the path or one of its parents is a regular file); not fatal:
    this machine cannot write there (a cluster path checked from a laptop may be fine)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        return f"{p} exists and is not a directory", True
    anc = p
    while not anc.exists():
        if anc.parent == anc:
            break
        anc = anc.parent
    if anc.exists() and not anc.is_dir():
        return f"{p} lies under {anc}, which is a regular file, not a directory", True
    if not os.access(anc, os.W_OK | os.X_OK):
        return f"{anc} is not writable by this user, so {p} cannot be created/written", False
    return None


def check_run_paths(cfg: DictConfig, issues: list[ConfigIssue], *, run: bool) -> None:
    """``logger.log_dir`` and ``checkpointing.checkpoint_dir`` must be writable directories.

    Under a regular file is always an error; not writable here is an error for a run
    (``run=True``) and a warning for `jetrl check` (the run may happen on another machine)."""
    for key in ("logger.log_dir", "checkpointing.checkpoint_dir"):
        val = _select(cfg, key)
        if not isinstance(val, str) or not val:
            continue
        found = path_problem(val)
        if found is None:
            continue
        msg, fatal = found
        level = "error" if fatal or run else "warning"
        issues.append(ConfigIssue(key, f"{msg}; choose a writable directory", (), level))  # type: ignore[arg-type]


# NeMo-RL's other programs, by the top-level section that names each (its MasterConfig's key):
# (what it is and its launcher, why there is no GRPO rollout to judge).
_GRPO_ONLY = (
    "jetrl check, align and train take GRPO configs only (a `grpo:` section: the rollouts "
    "policy.generation samples are what the trainer learns from)"
)
OTHER_PROGRAMS: dict[str, tuple[str, str, str]] = {
    "sft": ("SFT", "run_sft.py", "it trains on a fixed dataset and samples no rollout"),
    "dpo": ("DPO", "run_dpo.py", "it trains on fixed preference pairs and samples no rollout"),
    "rm": ("reward-model", "run_rm.py", "it trains on fixed preference pairs, no rollout"),
    "eval": ("evaluation", "run_eval.py", "it samples with `generation:` but trains nothing"),
    "distillation": (
        "distillation",
        "run_distillation.py",
        "its on-policy form samples the student with policy.generation (refit each step, as "
        "GRPO's), but its loss, teacher and launcher are not GRPO's, which this verdict, its "
        "backends and `jetrl train` assume (the cross-tokenizer off-policy form, "
        "run_xtoken_off_policy_distillation.py, samples no rollout at all)",
    ),
    "ppo": (
        "PPO",
        "run_ppo.py",
        "it samples rollouts with policy.generation, but its lag keys (ppo.async_ppo) and its "
        "value model are not GRPO's, which this verdict, its backends and `jetrl train` assume",
    ),
}


def program_issues(cfg: DictConfig) -> list[ConfigIssue]:
    """A config of another NeMo-RL program (SFT, DPO, RM, eval, distillation, PPO: its section
    and no ``grpo:``), a file with neither ``grpo:``, ``policy:`` nor ``jetrl:``, or a GRPO config whose ``policy.generation`` is null (NeMo-RL's
    run_grpo.py asserts it is set): no GRPO rollout to judge, an error naming why."""
    if "grpo" in cfg:
        gen = _select_given(cfg, "policy.generation")
        if gen is not None:
            return []
        return [
            ConfigIssue(
                "policy.generation",
                "null: a GRPO run samples its rollouts with policy.generation (NeMo-RL's "
                "run_grpo.py asserts it is set), so there is no rollout to judge; give it "
                "(e.g. backend: vllm)",
            )
        ]
    for key, (program, script, why) in OTHER_PROGRAMS.items():
        if key in cfg:
            return [
                ConfigIssue(
                    key,
                    f"not a GRPO config: a NeMo-RL {program} config (examples/{script}; "
                    f"top-level `{key}:`, no `grpo:`): {why}. {_GRPO_ONLY}",
                )
            ]
    if "policy" not in cfg and "jetrl" not in cfg and any(k in RUN_SECTIONS for k in cfg):
        # e.g. NeMo-Gym's prefetch_*_envs.yaml: only `env:`, read by a Docker build (a file with
        # only `jetrl:` is one of our recipe overlays, examples/configs/recipes/)
        given = ", ".join(f"{k}:" for k in list(cfg)[:5])
        return [
            ConfigIssue(
                "policy",
                f"missing, and no `grpo:` either: this file ({given}) describes no GRPO run "
                "(NeMo-Gym's prefetch_*_envs.yaml, with only env:, configure a Docker build); "
                f"a GRPO run names its model and rollout under policy:. {_GRPO_ONLY}",
            )
        ]
    return []


def _select_given(cfg: DictConfig, key: str) -> Any:
    """The value at ``key``; `ABSENT` when the key is not given (or cannot be read)."""
    try:
        return OmegaConf.select(cfg, key, default=ABSENT)
    except OmegaConfBaseException:
        return ABSENT


def check_run_keys(cfg: DictConfig, *, run: bool = False) -> list[ConfigIssue]:
    """Every problem of the run keys (types, ranges, bounds) and of the run's directories."""
    issues: list[ConfigIssue] = []
    if not any(k in RUN_SECTIONS for k in cfg):
        issues.append(
            ConfigIssue(
                "<file>",
                f"none of its keys ({', '.join(map(str, list(cfg)[:5]))}) is a section of a "
                f"GRPO run ({', '.join(RUN_SECTIONS)}): it does not describe a run",
            )
        )
    issues.extend(program_issues(cfg))
    name = _select(cfg, "policy.model_name")
    if run and (not isinstance(name, str) or not name.strip()):  # `check` may ask "what if"
        got = "missing" if name is None else f"got {name!r}"
        issues.append(
            ConfigIssue(
                "policy.model_name",
                f"{got}; a run names its model here (NeMo-RL's key: a HF name or directory; the "
                f"local backend's configs use {LOCAL_MODEL_NAME}, "
                "examples/configs/local/base.yaml)",
            )
        )
    read_run_keys(cfg, issues)
    issues.extend(_typo_issues(cfg, run=run))
    check_run_paths(cfg, issues, run=run)
    return issues


def _typo_issues(cfg: DictConfig, *, run: bool) -> list[ConfigIssue]:
    """A typo of a key we read: its value would silently not be read (NeMo-RL ignores it too).
    An error where a run starts (``run``) or the local backend reads the keys itself; a warning
    for `jetrl check` of a cluster config. ``jetrl.not_typos`` names keys meant as written."""
    meant = _select(cfg, "jetrl.not_typos")
    meant = (
        {str(k) for k in meant}
        if isinstance(meant, Sequence) and not isinstance(meant, str)
        else set()
    )
    typos = [
        i
        for i in near_misses(RunConfig, OmegaConf.to_container(cfg, resolve=False))
        if i.path not in meant
    ]
    if not (run or isinstance(_select(cfg, "jetrl.local"), Mapping)):
        return typos
    escape = "; if it is meant as written (a NeMo-RL key jetrl does not know), list it in jetrl.not_typos"
    return [replace(i, level="error", message=i.message + escape) for i in typos]
