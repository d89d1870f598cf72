"""Read and write NeMo-RL run directories (TensorBoard scalars + per-step training data).

NeMo-RL's ``Logger`` (nemo_rl/utils/logger.py) writes, under its ``logger.log_dir``:

  tensorboard/events.out.tfevents.*      scalars from ``log_metrics(metrics, step, prefix)``,
                                         tag ``f"{prefix}/{name}"``: ``train/token_mult_prob_error``,
                                         ``train/gen_kl_error``, ``train/reward``,
                                         ``validation/accuracy``, ``timing/train/...``;
                                         ``add_hparams`` adds a timestamped sub-directory.
  train_data_step{N}.jsonl               one line per sample (grpo.py), each field sliced to a
                                         batch of one: ``"generation_logprobs": [[...]]``,
                                         ``"prev_logprobs": [[...]]``, ``"token_loss_mask": [[...]]``,
                                         ``"sample_loss_mask": [1]``, ``"rewards": [r]``,
                                         ``"advantages"``, ``"token_ids"``, ``"input_lengths"``,
                                         ``"content"``, plus ``"idx"``.

`read_run` finds event files anywhere under the run directory, merges their scalars (for a
step logged twice, e.g. after a restart, the later wall time wins) and, where a mismatch metric
or the reward is missing for a step that has a ``train_data_step{N}.jsonl``, recomputes it from
the per-token logprobs with `nemo_jetrl.rl.metrics.mismatch_metrics`. As NeMo-RL's loss does
(``[:, 1:]``), position 0 of each sequence is ignored: logprob t belongs to token t, and token
0 has no logprob. Only that recomputation needs torch: reading needs tensorboard (its event
reader) and omegaconf, so `jetrl compare` runs in a light venv; there, steps that would be
recomputed are compared as logged, with a warning (``recompute="always"`` raises
`MissingDependencyError`).

Nothing here crashes on bad data: a truncated or corrupt events file keeps the records before
the damage, a broken jsonl line is skipped, a missing metric is reported; every such event is a
message in ``RunData.warnings`` (also issued as a `RunDataWarning`).

`RunWriter` writes the same layout (the local backend uses it), plus ``config.yaml`` (the run's
config; ``jetrl.recipe`` in it labels the run in ``jetrl compare``).

The readers live in `nemo_jetrl.runs.tensorboard` (events files) and
`nemo_jetrl.runs.train_data` (jsonl); their names are importable from here too.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_jetrl._optional import MissingDependencyError, require
from nemo_jetrl.rl.metric_names import metric_names
from nemo_jetrl.runs.tensorboard import (
    EVENTS_GLOB,
    TB_SUBDIR,
    Series,
    event_file_run_id,
    find_event_files,
    read_event_file,
    read_scalars,
)
from nemo_jetrl.runs.train_data import (
    GEN_FIELD,
    PREV_FIELD,
    REWARD_FIELD,
    SAMPLE_MASK_FIELD,
    TOKEN_MASK_FIELD,
    TRAIN_DATA_RE,
    read_train_data,
    recompute_step_metrics,
    train_data_files,
    train_data_tensors,
)

__all__ = [
    "CONFIG_FILE",
    "EVENTS_GLOB",
    "GEN_FIELD",
    "PREV_FIELD",
    "REWARD_FIELD",
    "SAMPLE_MASK_FIELD",
    "TB_SUBDIR",
    "TOKEN_MASK_FIELD",
    "TRAIN_DATA_RE",
    "RunData",
    "RunDataWarning",
    "Series",
    "find_event_files",
    "mixed_runs_message",
    "read_config",
    "read_event_file",
    "read_run",
    "read_scalars",
    "read_train_data",
    "recompute_step_metrics",
    "run_ids",
    "run_label",
    "train_data_files",
    "train_data_tensors",
]

#: the run's config snapshot (NeMo-RL writes config.yaml beside checkpoints; we keep one here).
CONFIG_FILE = "config.yaml"


class RunDataWarning(UserWarning):
    """Something in a run directory could not be read; the result is partial."""


@dataclass
class RunData:
    """What `read_run` found in one run directory."""

    path: Path
    """The run directory."""

    label: str
    """display name: ``jetrl.run_name`` / ``jetrl.recipe`` from config.yaml or the TensorBoard
    hparams when present, else the directory name."""

    scalars: dict[str, Series] = field(default_factory=dict)
    """Every scalar tag found (TensorBoard, gaps filled from train_data jsonl)."""

    config: dict[str, Any] | None = None
    """the run's config.yaml as a plain dict (None when absent or unreadable)."""

    train_data_steps: tuple[int, ...] = ()
    """steps that have a train_data_step{N}.jsonl file."""

    hparams: dict[str, Any] = field(default_factory=dict)
    """NeMo-RL's ``add_hparams`` record (flattened config), {} when absent."""

    run_ids: tuple[str, ...] = ()
    """ids of the runs whose events files are here (`RunWriter` names them; more than one: several
    runs wrote into this directory and the label says ``[mixed: N runs]``)."""

    warnings: list[str] = field(default_factory=list)
    """What could not be read (the data above is partial then)."""

    parts: tuple[Path, ...] = ()
    """the directories of one run resumed across several (``exp_001``, ``exp_002``... joined by
    `nemo_jetrl.runs.resume.join_resumed`), oldest first; () for a run in one directory."""

    joined: str = ""
    """how the parts were joined (each part's steps, which steps the later part replaced)."""

    def tags(self) -> list[str]:
        return sorted(self.scalars)

    def step_series(self) -> list[Series]:
        """The series whose steps are training steps (not NeMo-RL's ``ray/*`` GPU monitor,
        `Series.on_step_axis`)."""
        return [s for s in self.scalars.values() if s.on_step_axis]

    @property
    def last_step(self) -> int | None:
        steps = [s.steps[-1] for s in self.step_series() if s.steps]
        return max(steps) if steps else None


def mixed_runs_message(ids: Iterable[str]) -> str:
    ids = list(ids)
    return (
        f"TensorBoard events of {len(ids)} different runs ({', '.join(ids)}): their steps are "
        "merged (a step logged twice keeps the later value) and config.yaml / train_data "
        "describe the last one; give each run its own logger.log_dir"
    )


def _warn(sink: list[str], msg: str, stacklevel: int = 3) -> None:
    """Record ``msg`` in ``sink`` and warn it (`RunDataWarning`) at the caller's caller, or
    ``stacklevel`` frames up."""
    sink.append(msg)
    warnings.warn(msg, RunDataWarning, stacklevel=stacklevel)


# ----------------------------------------------------------------------------- run dirs


def read_config(run_dir: str | Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The run's config.yaml as a dict (None if absent), and warnings."""
    p = Path(run_dir) / CONFIG_FILE
    if not p.is_file():
        return None, []
    try:
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(OmegaConf.load(p), resolve=False)
    except Exception as exc:
        return None, [
            f"{p}: unreadable config ({type(exc).__name__}: {exc}); label from the directory name"
        ]
    return (cfg if isinstance(cfg, dict) else None), []


def run_ids(run_dir: str | Path) -> tuple[str, ...]:
    """Distinct run ids in the names of the events files under ``run_dir``, oldest first
    (files from writers that do not name a run are not counted)."""
    ids: list[str] = []
    for f in sorted(find_event_files(run_dir), key=lambda p: p.name):
        rid = event_file_run_id(f)
        if rid and rid not in ids:
            ids.append(rid)
    return tuple(ids)


def run_label(
    run_dir: str | Path,
    config: Mapping[str, Any] | None,
    hparams: Mapping[str, Any] | None = None,
) -> str:
    """``jetrl.run_name`` or ``jetrl.recipe`` from the config (then from NeMo-RL's flattened
    hparams), else the directory name."""
    jet = (config or {}).get("jetrl")
    if isinstance(jet, Mapping):
        for key in ("run_name", "recipe"):
            v = jet.get(key)
            if isinstance(v, Mapping):
                v = v.get("name")
            if isinstance(v, str) and v.strip():
                return v.strip()
    for key in ("jetrl.run_name", "jetrl.recipe", "jetrl.recipe.name"):
        v = (hparams or {}).get(key)
        if isinstance(v, str) and v.strip():
            return v.strip()
    return Path(run_dir).resolve().name


def read_run(
    run_dir: str | Path,
    *,
    recompute: str = "missing",
    tags: Iterable[str] | None = None,
    ratio_bounds: tuple[float, float] | None = None,
) -> RunData:
    """Read one NeMo-RL (or `RunWriter`) run directory; never raises on bad content.

    Args:
        run_dir: the run's ``logger.log_dir``.
        recompute: "missing" (fill steps where a recomputable tag is absent from TensorBoard),
            "always" (recompute and prefer jsonl values) or "never".
        tags: the tags the caller needs; with "missing", jsonl files are read only when one of
            these recomputable tags lacks a step (None: any recomputable tag).
        ratio_bounds: bounds for the recomputed importance-ratio statistics.

    Raises:
        FileNotFoundError: ``run_dir`` is not a directory.
        MissingDependencyError: recompute="always" with jsonl files and no torch.
    """
    if recompute not in ("missing", "always", "never"):
        raise ValueError(f"recompute must be 'missing', 'always' or 'never', got {recompute!r}")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    run, files = _read_logged(run_dir)
    if recompute == "never" or not files:
        return run
    lacking = _lacking_recomputable(run.scalars, files, tags)
    if recompute == "missing" and not lacking:
        return run
    if not _torch_to_recompute(run, lacking, strict=recompute == "always"):
        return run
    computed, w = _recompute_from_jsonl(files, ratio_bounds)
    for m in w:
        _warn(run.warnings, m)
    _merge_recomputed(run.scalars, computed, prefer_jsonl=recompute == "always")
    return run


def _read_logged(run_dir: Path) -> tuple[RunData, dict[int, Path]]:
    """The run as logged (config.yaml, TensorBoard scalars and hparams, run ids, label,
    warnings emitted) and its train_data jsonl files by step; nothing recomputed yet."""
    msgs: list[str] = []  # warned at read_run's caller (stacklevel=4), as read_run's own
    config, w = read_config(run_dir)
    for m in w:
        _warn(msgs, m, stacklevel=4)
    hparams: dict[str, Any] = {}
    series, w = read_scalars(run_dir, hparams_out=hparams)
    for m in w:
        _warn(msgs, m, stacklevel=4)
    files = train_data_files(run_dir)
    ids = run_ids(run_dir)
    label = run_label(run_dir, config, hparams)
    if len(ids) > 1:
        label += f" [mixed: {len(ids)} runs]"
        _warn(msgs, f"{run_dir}: {mixed_runs_message(ids)}", stacklevel=4)
    run = RunData(
        path=run_dir,
        label=label,
        run_ids=ids,
        hparams=hparams,
        scalars=series,
        config=config,
        train_data_steps=tuple(files),
        warnings=msgs,
    )
    if not series and not files:
        n = sum(p.is_file() for p in run_dir.rglob(EVENTS_GLOB))
        what = (
            f"no scalars read from its {n} TensorBoard events file(s)"
            if n
            else ("no TensorBoard events")
        )  # the warnings above say why a file could not be read
        _warn(msgs, f"{run_dir}: {what} and no train_data_step*.jsonl found", stacklevel=4)
    return run, files


def _lacking_recomputable(
    series: Mapping[str, Series], files: Mapping[int, Path], tags: Iterable[str] | None
) -> list[str]:
    """The wanted recomputable ``tags`` (None: any) that lack a step that has a train_data
    jsonl file."""
    recomputable = [*metric_names(), "train/reward"]
    wanted = recomputable if tags is None else [t for t in tags if t in recomputable]
    return [t for t in wanted if t not in series or not set(files) <= set(series[t].steps)]


def _torch_to_recompute(run: RunData, lacking: Sequence[str], *, strict: bool) -> bool:
    """Whether torch imports: recomputing from jsonl is torch maths (`nemo_jetrl.rl.metrics`),
    and `jetrl compare` runs where torch may be absent (a login node's light venv). Without it
    ``strict`` (recompute="always") raises `MissingDependencyError`; otherwise the run stays as
    logged, with a warning naming the ``lacking`` tags."""
    try:
        require("torch", feature="recomputing metrics from train_data_step*.jsonl")
    except MissingDependencyError:
        if strict:
            raise
        shown = ", ".join(lacking[:6]) + (
            f" and {len(lacking) - 6} more" if len(lacking) > 6 else ""
        )
        _warn(
            run.warnings,
            f"{run.path}: {shown} lack steps that train_data_step*.jsonl has; recomputing them "
            "needs torch, which is not importable here: compared as logged (install torch, the "
            "CPU build is enough, to recompute them; --recompute never silences this)",
            stacklevel=4,
        )
        return False
    return True


def _recompute_from_jsonl(
    files: Mapping[int, Path], ratio_bounds: tuple[float, float] | None
) -> tuple[dict[str, dict[int, float]], list[str]]:
    """({tag: {step: value}} recomputed from each step's train_data jsonl, warnings); a file
    that cannot be read or recomputed is skipped with a warning."""
    computed: dict[str, dict[int, float]] = {}
    msgs: list[str] = []
    for step, path in files.items():
        records, w = read_train_data(path)
        msgs.extend(w)
        if not records:
            continue
        try:
            vals = recompute_step_metrics(records, ratio_bounds=ratio_bounds)
        except (ValueError, TypeError) as exc:
            msgs.append(f"{path}: cannot recompute metrics: {exc}")
            continue
        for tag, v in vals.items():
            computed.setdefault(tag, {})[step] = v
    return computed, msgs


def _merge_recomputed(
    series: dict[str, Series], computed: Mapping[str, Mapping[int, float]], *, prefer_jsonl: bool
) -> None:
    """Merge recomputed values into ``series`` in place: with ``prefer_jsonl`` they replace
    logged values, else they only fill steps TensorBoard lacks."""
    for tag, pts in computed.items():
        old = series.get(tag)
        merged = dict(zip(old.steps, old.values, strict=True)) if old else {}
        if prefer_jsonl:
            merged.update(pts)
        else:
            added = {s: v for s, v in pts.items() if s not in merged}
            if not added:
                continue
            merged.update(added)
        source = "jsonl" if not old else "tensorboard+jsonl"
        steps = tuple(sorted(merged))
        series[tag] = Series(tag, steps, tuple(merged[s] for s in steps), source)
