"""Compare runs side by side: per-run metric summaries, a text table, JSON/CSV, PNG plots.

For each run and metric the summary holds the last value, mean, median and max over the logged
steps, the number of steps covered and the first/last step. Non-finite values (a NaN metric of an
empty batch) are left out of the statistics and reported. Runs of different lengths are summarised
over their own steps, with a warning, so "last" of a shorter run is not mistaken for the same
point in training.

Metric names: a full tag (``train/token_mult_prob_error``), a NeMo-RL short name
(``token_mult_prob_error``, looked up under ``train/`` then ``validation/`` then
``jetrl/mismatch/``), or an alias (`ALIASES`, their one home: ``tmpe`` and ``gen_kl``, the
README's names (``tmpe`` also the progress bar's), ``reward`` -> ``train/reward``,
``accuracy`` -> ``validation/accuracy``). Defaults: `DEFAULT_METRICS`.

Plots use matplotlib's object API with the Agg canvas (no pyplot, no global backend switch):
one PNG per metric, one labelled line per run, step on the x axis.
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nemo_jetrl._optional import require
from nemo_jetrl.rl.metric_names import JETRL_PREFIX, metric_names
from nemo_jetrl.runs.logs import RunData, read_run
from nemo_jetrl.runs.resume import join_resumed

#: NeMo-RL tags (grpo.py logs loss metrics and reward with prefix "train", validation with
#: "validation").
DEFAULT_METRICS = (
    "train/token_mult_prob_error",
    "train/gen_kl_error",
    # ours (local backend and the NeMo-RL loss wrapper log them; recomputed from train_data
    # jsonl where missing): per-token mismatch and the importance ratio's mean
    "jetrl/mismatch/k1_kl",
    "jetrl/mismatch/chi2_token",
    "jetrl/mismatch/is_ratio_mean",
    "train/reward",
    "validation/accuracy",
)
#: the one home of metric aliases (short names the README uses; ``tmpe`` is also the local
#: backend's progress bar's); `resolve_tag` and `canonical_metric` read them.
ALIASES = {
    "tmpe": "train/token_mult_prob_error",
    "gen_kl": "train/gen_kl_error",
    "reward": "train/reward",
    "accuracy": "validation/accuracy",
    "validation_accuracy": "validation/accuracy",
    "val_accuracy": "validation/accuracy",
}
_SEARCH_PREFIXES = ("train/", "validation/", JETRL_PREFIX)


@dataclass(frozen=True)
class MetricSummary:
    """One run x one metric. Statistics are NaN and steps 0 when the run lacks the metric."""

    label: str
    """The run's display name."""

    run_dir: str
    """The run directory."""

    metric: str
    """The metric as requested."""

    tag: str | None
    """The tag it resolved to in this run (None: not found)."""

    last: float
    """Value at the last step."""

    mean: float
    """Mean over finite values."""

    median: float
    """Median over finite values."""

    max: float
    """Largest finite value."""

    steps: int
    """Number of steps with a finite value."""

    first_step: int | None
    """First step with a finite value."""

    last_step: int | None
    """Last step with a finite value."""

    source: str
    """where the values came from: tensorboard, jsonl or tensorboard+jsonl ("" when missing)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CompareResult:
    """What `compare_runs` produced."""

    runs: list[RunData]
    summaries: list[MetricSummary]
    table: str
    plots: list[Path] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    metrics: list[str] = field(default_factory=list)
    """The metrics as requested (summaries hold them per run, in this order)."""


def resolve_tag(name: str, available: Iterable[str]) -> str | None:
    """The tag ``name`` refers to among ``available`` (see the module docstring), or None."""
    tags = set(available)
    if name in tags:
        return name
    alias = ALIASES.get(name)
    if alias in tags:
        return alias
    for prefix in _SEARCH_PREFIXES:
        if prefix + name in tags:
            return prefix + name
    ends = sorted(t for t in tags if t.rsplit("/", 1)[-1] == name)
    return ends[0] if len(ends) == 1 else None


def canonical_metric(name: str) -> str:
    """The full tag a requested name stands for (used to ask for recomputation, name files, and
    show metrics no run has): aliases, then `mismatch_metrics`' tags, else ``train/<name>``."""
    if "/" in name:
        return name
    if name in ALIASES:
        return ALIASES[name]
    known = [t for t in metric_names() if t.rsplit("/", 1)[-1] == name]
    return known[0] if known else "train/" + name


def unique_labels(runs: Sequence[RunData]) -> list[str]:
    """Run labels, disambiguated with the directory name (then an index) when they repeat."""
    labels = [r.label for r in runs]
    out = []
    for r, lab in zip(runs, labels, strict=True):
        if labels.count(lab) > 1 and lab != r.path.resolve().name:
            lab = f"{lab} ({r.path.resolve().name})"
        out.append(lab)
    seen: dict[str, int] = {}
    final = []
    for lab in out:
        n = seen.get(lab, 0)
        seen[lab] = n + 1
        final.append(lab if n == 0 and out.count(lab) == 1 else f"{lab} #{n + 1}")
    return final


def _run_dirs(run: RunData) -> str:
    """The run's directory, or its directories joined by '+' (a resumed run)."""
    return "+".join(str(p) for p in run.parts) if run.parts else str(run.path)


def summarize(
    runs: Sequence[RunData], metrics: Sequence[str] = DEFAULT_METRICS
) -> tuple[list[MetricSummary], list[str]]:
    """Summaries (run-major order) and warnings for missing metrics, NaNs, unequal lengths."""
    labels = unique_labels(runs)
    out: list[MetricSummary] = []
    msgs: list[str] = []
    nan = math.nan
    for run, label in zip(runs, labels, strict=True):
        for metric in metrics:
            tag = resolve_tag(metric, run.scalars)
            if tag is None:
                msgs.append(f"{label}: no metric {metric!r} in {run.path}")
                out.append(
                    MetricSummary(
                        label, _run_dirs(run), metric, None, nan, nan, nan, nan, 0, None, None, ""
                    )
                )
                continue
            s = run.scalars[tag]
            pts = [(st, v) for st, v in zip(s.steps, s.values, strict=True) if math.isfinite(v)]
            if len(pts) < len(s.steps):
                msgs.append(
                    f"{label}: {tag} has {len(s.steps) - len(pts)} non-finite value(s), left out"
                )
            vals = [v for _, v in pts]
            out.append(
                MetricSummary(
                    label=label,
                    run_dir=_run_dirs(run),
                    metric=metric,
                    tag=tag,
                    last=vals[-1] if vals else nan,
                    mean=statistics.fmean(vals) if vals else nan,
                    median=statistics.median(vals) if vals else nan,
                    max=max(vals) if vals else nan,
                    steps=len(vals),
                    first_step=pts[0][0] if pts else None,
                    last_step=pts[-1][0] if pts else None,
                    source=s.source,
                )
            )
    ends = {
        lab: r.last_step for r, lab in zip(runs, labels, strict=True) if r.last_step is not None
    }
    if len(set(ends.values())) > 1:
        msgs.append(
            "runs have different lengths (last step: "
            + ", ".join(f"{k}: {v}" for k, v in ends.items())
            + "); each run is summarised over its own steps"
        )
    return out, msgs


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "-"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.4e}"
    return f"{v:.6g}"


def format_table(summaries: Sequence[MetricSummary], notes: Sequence[str] = ()) -> str:
    """A plain-text table: one row per run and metric, then ``notes`` (e.g. joined runs)."""
    head = ["run", "metric", "last", "mean", "median", "max", "steps", "range"]
    rows = [head]
    for s in summaries:
        rng = f"{s.first_step}-{s.last_step}" if s.steps else "missing"
        rows.append(
            [s.label, s.tag or canonical_metric(s.metric), _fmt(s.last), _fmt(s.mean),
             _fmt(s.median), _fmt(s.max), str(s.steps), rng]
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for i, r in enumerate(rows):
        cells = [
            c.ljust(w) if j < 2 else c.rjust(w)
            for j, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.extend(f"joined: {n}" for n in notes)
    return "\n".join(lines)


def write_json(
    path: str | Path, summaries: Sequence[MetricSummary], *, warnings: Sequence[str] = ()
) -> Path:
    """``{"summaries": [...], "warnings": [...]}``; NaN written as null."""

    def clean(d: dict[str, Any]) -> dict[str, Any]:
        return {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()
        }

    path = Path(path)
    payload = {"summaries": [clean(s.to_dict()) for s in summaries], "warnings": list(warnings)}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def write_csv(path: str | Path, summaries: Sequence[MetricSummary]) -> Path:
    """One row per run and metric; missing statistics are empty cells."""
    path = Path(path)
    cols = list(MetricSummary.__dataclass_fields__)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for s in summaries:
            d = s.to_dict()
            w.writerow(
                {
                    k: ("" if (isinstance(v, float) and math.isnan(v)) or v is None else v)
                    for k, v in d.items()
                }
            )
    return path


def _slug(tag: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", tag).strip("_") or "metric"


def plot_path(out_dir: Path, metric: str) -> Path:
    """Where `write_outputs` puts ``metric``'s PNG in ``out_dir``."""
    return out_dir / f"{_slug(canonical_metric(metric))}.png"


def plot_metric(runs: Sequence[RunData], metric: str, path: str | Path) -> Path | None:
    """PNG of one metric against step, one labelled line per run that has it; None if none has."""
    require("matplotlib", feature="jetrl compare plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = unique_labels(runs)
    fig = Figure(figsize=(7.5, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    lines = []
    tags = set()
    for run, label in zip(runs, labels, strict=True):
        tag = resolve_tag(metric, run.scalars)
        if tag is None:
            continue
        s = run.scalars[tag]
        pts = [(st, v) for st, v in zip(s.steps, s.values, strict=True) if math.isfinite(v)]
        if pts:
            tags.add(tag)
            lines.append((label, pts))
    # markers only when every line is short enough for them to stay readable (same style for all)
    marker = "o" if lines and max(len(p) for _, p in lines) <= 30 else None
    shown = []
    styles = ("-", "--", "-.", ":")  # so runs that coincide stay distinguishable
    for i, (label, pts) in enumerate(lines):
        xs, ys = zip(*pts, strict=True)
        ax.plot(
            xs, ys, styles[i % len(styles)], marker=marker, markersize=3, linewidth=1.6, label=label
        )
        shown.append(label)
    if not shown:
        return None
    title = sorted(tags)[0] if len(tags) == 1 else canonical_metric(metric)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(title.rsplit("/", 1)[-1])
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def compare_runs(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path | None = None,
    *,
    metrics: Sequence[str] | None = None,
    formats: Sequence[str] = ("json", "csv"),
    plots: bool = True,
    recompute: str = "missing",
) -> CompareResult:
    """Read the runs, summarise ``metrics``, and (with ``out_dir``) write summary files and plots
    (`write_outputs`; ``out_dir=None`` writes nothing, for a caller that checks first).

    Raises FileNotFoundError when a run directory does not exist; bad content only warns.
    """
    metrics = list(metrics or DEFAULT_METRICS)
    wanted = [canonical_metric(m) for m in metrics]
    # a job resubmitted after its time limit (exp_001, exp_002...) is one run
    runs = join_resumed([read_run(d, recompute=recompute, tags=wanted) for d in run_dirs])
    msgs = [f"{r.label}: {m}" for r in runs for m in r.warnings]
    summaries, w = summarize(runs, metrics)
    msgs.extend(w)
    table = format_table(summaries, notes=[r.joined for r in runs if r.joined])
    result = CompareResult(
        runs=runs, summaries=summaries, table=table, warnings=msgs, metrics=metrics
    )
    if out_dir is None:
        return result
    return write_outputs(result, out_dir, formats=formats, plots=plots)


def write_outputs(
    result: CompareResult,
    out_dir: str | Path,
    *,
    formats: Sequence[str] = ("json", "csv"),
    plots: bool = True,
) -> CompareResult:
    """Write ``result``'s summary files (``formats``) and, with ``plots``, one PNG per metric
    some run has into ``out_dir`` (created); the paths are added to ``result``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    msgs = result.warnings
    if "json" in formats:
        result.files.append(write_json(out / "summary.json", result.summaries, warnings=msgs))
    if "csv" in formats:
        result.files.append(write_csv(out / "summary.csv", result.summaries))
    if plots:
        for metric in result.metrics:
            p = plot_metric(result.runs, metric, plot_path(out, metric))
            if p is None:
                msgs.append(f"no run has {metric!r}: no plot")
            else:
                result.plots.append(p)
    return result
