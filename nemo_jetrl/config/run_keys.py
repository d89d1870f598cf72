"""The NeMo-RL keys of a GRPO run, one rule each: ``grpo.*``, ``policy.optimizer.kwargs.*``,
sampling, checkpointing and the log directory.

Every backend reads these keys with NeMo-RL's meaning, so their rules live here once: the
config validator (`jetrl check`, `align`, `train` on every backend) applies them through
`check_run_keys`, and the local backend reads its `RunSettings` through `read_run_keys`. Each
rule is a type, a range and, for sizes, a bound no machine can exceed (a step of more than
`MAX_RESPONSES_PER_STEP` responses would not fit in memory anywhere), so that ``lr=.inf`` or
``num_prompts_per_step=1e22`` are refused before any work starts instead of diverging or
crashing mid-run. `path_problem` is the rule for directories a run writes into.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_jetrl.config.load import ConfigIssue

# Responses (prompts x generations) one step may hold: 2**20 sequences is beyond any machine's
# memory for a real model, so a larger value is a typo (1e22), never a plan.
MAX_RESPONSES_PER_STEP = 1 << 20
# Steps, periods and token counts above this are typos too (2**31: int32 counters).
MAX_COUNT = (1 << 31) - 1
# torch.manual_seed accepts [0, 2**64); runs derive seeds by adding offsets below 2**32 (per
# step, per generator), so the run's seed stays below 2**63.
MAX_SEED = (1 << 63) - 1

# The top-level sections of a NeMo-RL GRPO config and ours: a file with none of them is a
# mistake (a typo'd file, the wrong file), never a run of defaults.
RUN_SECTIONS = (
    "policy",
    "grpo",
    "loss_fn",
    "data",
    "env",
    "logger",
    "checkpointing",
    "cluster",
    "jetrl",
)

_ABSENT = object()
_NUM = (int, float)


def _finite(v: Any) -> bool:
    return math.isfinite(float(v))


@dataclass(frozen=True)
class RunKey:
    """The rule of one NeMo-RL run key."""

    key: str
    """Dotted key path, e.g. "policy.optimizer.kwargs.lr"."""
    field: str
    """The `RunSettings` field it fills ("": checked only, no local setting)."""
    kinds: tuple[type, ...]
    """Accepted Python types (NoneType: null allowed); bool never counts as a number."""
    ok: Callable[[Any], bool] | None
    """Range check on a value of the right type (None: any value of the types)."""
    what: str
    """What is allowed, in words (the error message's "expected ...")."""


def _count(key: str, field: str, lo: int, hi: int = MAX_COUNT, null: bool = False) -> RunKey:
    kinds: tuple[type, ...] = (int, type(None)) if null else (int,)
    what = f"an integer in [{lo}, {hi}]" + (" or null" if null else "")
    return RunKey(key, field, kinds, lambda v: lo <= v <= hi, what)


def _flag(key: str, field: str) -> RunKey:
    return RunKey(key, field, (bool,), None, "true or false")


def _positive(key: str, field: str, null: bool = False) -> RunKey:
    kinds: tuple[type, ...] = (*_NUM, type(None)) if null else _NUM
    what = "a finite number > 0" + (" or null" if null else "")
    return RunKey(key, field, kinds, lambda v: _finite(v) and v > 0, what)


def _non_negative(key: str, field: str) -> RunKey:
    return RunKey(key, field, _NUM, lambda v: _finite(v) and v >= 0, "a finite number >= 0")


def _fraction(key: str, field: str) -> RunKey:
    return RunKey(key, field, _NUM, lambda v: 0 <= v < 1, "a number in [0, 1)")


RUN_KEYS: tuple[RunKey, ...] = (
    _count("grpo.num_prompts_per_step", "num_prompts_per_step", 1, MAX_RESPONSES_PER_STEP),
    _count("grpo.num_generations_per_prompt", "num_generations_per_prompt", 1, MAX_RESPONSES_PER_STEP),
    _count("grpo.max_num_steps", "max_num_steps", 0),
    # NeMo-RL validates when val_period > 0; its own configs write -1 for "never".
    _count("grpo.val_period", "val_period", -1),
    _flag("grpo.val_at_start", "val_at_start"),
    _count("grpo.seed", "seed", 0, MAX_SEED),
    _flag("grpo.normalize_rewards", "normalize_rewards"),
    _flag("grpo.use_leave_one_out_baseline", "use_leave_one_out_baseline"),
    _positive("policy.generation.temperature", "temperature"),
    _count("policy.generation.max_new_tokens", "max_new_tokens", 1, null=True),
    _positive("policy.optimizer.kwargs.lr", "lr"),
    _non_negative("policy.optimizer.kwargs.weight_decay", "weight_decay"),
    _positive("policy.optimizer.kwargs.eps", "eps"),
    _positive("policy.max_grad_norm", "max_grad_norm", null=True),
    _flag("checkpointing.enabled", "checkpoint_enabled"),
    RunKey("checkpointing.checkpoint_dir", "checkpoint_dir", (str, type(None)), None, "a path"),
    _count("checkpointing.save_period", "save_period", 1),
    _count("checkpointing.keep_top_k", "keep_top_k", 1, null=True),
    RunKey("logger.log_dir", "log_dir", (str,), bool, "a non-empty directory path"),
    # Megatron's optimizer (checked only: the local backend trains with the keys above).
    _positive("policy.megatron_cfg.optimizer.lr", ""),
    _non_negative("policy.megatron_cfg.optimizer.min_lr", ""),
    _non_negative("policy.megatron_cfg.optimizer.weight_decay", ""),
    _positive("policy.megatron_cfg.optimizer.adam_eps", ""),
    _fraction("policy.megatron_cfg.optimizer.adam_beta1", ""),
    _fraction("policy.megatron_cfg.optimizer.adam_beta2", ""),
)  # fmt: skip
BETAS_KEY = "policy.optimizer.kwargs.betas"


def _type_ok(value: Any, kinds: tuple[type, ...]) -> bool:
    if bool in kinds:
        return isinstance(value, bool)
    return not isinstance(value, bool) and isinstance(value, kinds)


def _select(cfg: DictConfig, key: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, default=_ABSENT)
    except OmegaConfBaseException:
        return _ABSENT  # an unresolvable value: the interpolation check names it


def read_run_keys(cfg: DictConfig, issues: list[ConfigIssue]) -> dict[str, Any]:
    """``{field: value}`` of every run key present and valid; one issue per bad key."""
    out: dict[str, Any] = {}
    for rule in RUN_KEYS:
        val = _select(cfg, rule.key)
        if val is _ABSENT:
            continue
        if val is None and type(None) in rule.kinds:
            if rule.field:
                out[rule.field] = None
            continue
        kinds = tuple(k for k in rule.kinds if k is not type(None))
        if not _type_ok(val, kinds) or (rule.ok is not None and not rule.ok(val)):
            issues.append(ConfigIssue(rule.key, f"got {val!r}; expected {rule.what}"))
            continue
        if rule.field:
            out[rule.field] = float(val) if float in kinds else val
    if out.get("val_period", 0) < 0:
        out["val_period"] = 0  # NeMo-RL's "never" (val_period <= 0)
    betas = _select(cfg, BETAS_KEY)
    if betas is not _ABSENT and betas is not None:
        try:
            b = tuple(float(x) for x in betas)
            if len(b) != 2 or not all(0 <= x < 1 for x in b):
                raise ValueError
            out["betas"] = b
        except (TypeError, ValueError):
            issues.append(ConfigIssue(BETAS_KEY, f"got {betas!r}; expected [b1, b2] in [0, 1)"))
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
    return out


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
    name = OmegaConf.select(cfg, "policy.model_name", default=None)
    if run and (not isinstance(name, str) or not name.strip()):  # `check` may ask "what if"
        got = "missing" if name is None else f"got {name!r}"
        issues.append(
            ConfigIssue(
                "policy.model_name",
                f"{got}; a run names its model here (NeMo-RL's key: a HF name or directory; the "
                "local backend's configs use nemo-jetrl/local-tiny-llama, "
                "examples/configs/local/base.yaml)",
            )
        )
    read_run_keys(cfg, issues)
    check_run_paths(cfg, issues, run=run)
    return issues
