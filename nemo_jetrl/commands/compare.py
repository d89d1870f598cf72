"""`jetrl compare RUN_DIR... [-o OUT] [--metric ...]`: put NeMo-RL runs side by side.

Reads each run directory (TensorBoard scalars anywhere under it, train_data_step*.jsonl to
recompute missing mismatch metrics), labels each by the recipe / ``jetrl.run_name`` its logged
hyperparameters name, joins a job resumed across ``exp_NNN`` directories into one run
(``runs/resume.py``), prints a table per run and metric (last, mean, median, max, steps
covered), and writes summary.json / summary.csv and one PNG per metric into OUT.
Refused (exit 2) before anything is read, every such problem at once: a RUN_DIR that is
missing, a file, or not a run directory (no TensorBoard events or train_data_step*.jsonl under
it), a run directory holding the events of several runs (``--allow-mixed`` compares it,
labelled), an OUT that is a file or cannot be created, is a compared run directory or lies
inside one, or holds a file this compare would write (an earlier compare's: ``--force``
overwrites them). Refused (exit 2) after reading and before anything is written: a run from whose
files (events, train_data jsonl) not one metric could be read (the run and those files named; a
run with some metrics keeps its read warnings), a ``--metric`` that no run has (named, with the
tags close to it; one that only some runs lack is a row), and runs that have none of the default
metrics.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nemo_jetrl.runs.logs import RunData
    from nemo_jetrl.runs.report import MetricSummary

NAME = "compare"
HELP = "Compare runs: table of mismatch metrics/reward/accuracy, JSON/CSV summary, PNG plots."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="NeMo-RL logger.log_dir of each run"
    )
    parser.add_argument(
        "-o", "--out", default="jetrl_compare", help="output directory (default: %(default)s)"
    )
    parser.add_argument(
        "--metric",
        action="append",
        default=None,
        metavar="NAME",
        help="metric tag, short name or alias (tmpe, gen_kl, reward, accuracy), repeatable or "
        "comma-separated; one no run has is refused, exit 2 (default: token_mult_prob_error, "
        "gen_kl_error, jetrl/mismatch/{k1_kl,chi2_token,is_ratio_mean}, reward, validation "
        "accuracy)",
    )
    parser.add_argument(
        "--format",
        choices=("json", "csv", "both"),
        default="both",
        help="machine-readable summary format (default: %(default)s)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--force",
        action="store_true",
        help="overwrite the summary files and plots an earlier compare wrote into OUT",
    )
    parser.add_argument(
        "--allow-mixed",
        action="store_true",
        help="compare a run directory holding events of several runs (labelled "
        "'[mixed: N runs]') instead of refusing it",
    )
    parser.add_argument(
        "--recompute",
        choices=("missing", "always", "never"),
        default="missing",
        help="recompute mismatch metrics from train_data_step*.jsonl: where missing (default), "
        "always, or never",
    )


def run(args: argparse.Namespace) -> int:
    import warnings

    from nemo_jetrl.commands._output import make_output_dir
    from nemo_jetrl.errors import MissingDependencyError, UserError
    from nemo_jetrl.runs.logs import RunDataWarning
    from nemo_jetrl.runs.report import DEFAULT_METRICS, compare_runs, write_outputs

    named = [m.strip() for arg in (args.metric or []) for m in arg.split(",") if m.strip()]
    metrics = named or list(DEFAULT_METRICS)
    formats = ("json", "csv") if args.format == "both" else (args.format,)
    out = Path(args.out)
    written = output_files(out, metrics, formats, plots=not args.no_plots)
    problems = run_dir_problems(args.run_dirs)
    if not args.allow_mixed:
        problems += mixed_run_problems(args.run_dirs)
    # -o is probed here, created only once the runs and metrics are checked
    problems += out_dir_problems(out, args.run_dirs, written, force=args.force)
    if problems:  # every problem with the paths at once
        raise UserError("; ".join(problems))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RunDataWarning)  # printed below, once
            res = compare_runs(args.run_dirs, None, metrics=metrics, recompute=args.recompute)
        unreadable = [why for r in res.runs if (why := unreadable_run(r))]
        if unreadable:  # not one metric read from its files: damaged, not metric-less
            raise UserError("; ".join(unreadable))
        # checked before anything is written: a metric asked for by name that no run has is
        # almost surely a typo (one some runs lack is a row); the defaults only all together
        absent = metrics_no_run_has(res.summaries)
        if named and absent:
            raise UserError(unknown_metrics_message(absent, res.runs))
        if len(absent) == len(metrics):
            for r in res.runs:  # what could not be read; not one "no metric" per metric
                for m in r.warnings:
                    print(f"warning: {r.label}: {m}", file=sys.stderr)
            raise UserError(
                f"none of the default metrics ({', '.join(metrics)}) was found in any run "
                f"(tags found: {tags_hint(res.runs)}); name the ones to compare with --metric"
            )
        make_output_dir(Path(args.out), "-o")
        write_outputs(res, args.out, formats=formats, plots=not args.no_plots)
    except MissingDependencyError as exc:
        raise UserError(str(exc)) from None
    print(res.table)
    for m in res.warnings:
        print(f"warning: {m}", file=sys.stderr)
    for p in [*res.files, *res.plots]:
        print(f"wrote {p}")
    return 0


def run_dir_problems(run_dirs: list[str]) -> list[str]:
    """Each RUN_DIR must exist and be a run directory (TensorBoard events anywhere under it or
    ``train_data_step*.jsonl`` in it), said first, before ``-o`` is created or a run read."""
    problems = []
    missing = [d for d in run_dirs if not Path(d).exists()]
    if missing:
        problems.append("run directory not found: " + ", ".join(missing))
    problems += [
        f"{d}: is a file, not a run directory; pass the directory the run logged into (its "
        "logger.log_dir)"
        for d in run_dirs
        if Path(d).exists() and not Path(d).is_dir()
    ]
    problems += [why for d in run_dirs if Path(d).is_dir() and (why := not_a_run_dir(d))]
    return problems


def output_files(out: Path, metrics: Sequence[str], formats: Sequence[str], plots: bool) -> list:
    """The files `write_outputs` may write into ``out``: the summaries and a PNG per metric."""
    from nemo_jetrl.runs.report import plot_path

    return [
        *(out / f"summary.{f}" for f in formats),
        *(plot_path(out, m) for m in metrics if plots),
    ]


def out_dir_problems(
    out: Path, run_dirs: list[str], written: Sequence[Path], *, force: bool = False
) -> list[str]:
    """Why ``-o`` cannot take this compare's output: an existing file, a compared run directory
    or a directory inside one (its own logs would get our summary), already holding ``written``
    (an earlier compare's output, lost silently before `--force`), a path of ``written`` that
    is not a file (no `--force` writes over a directory), or a directory this process cannot
    create and write into. Probed only: created (`make_output_dir`) once nothing is refused."""
    from nemo_jetrl.commands._output import check_output_dir
    from nemo_jetrl.errors import UserError

    if out.exists() and not out.is_dir():
        return [f"-o {out}: is an existing file, not a directory; choose another -o"]
    problems = []
    where = out.resolve()
    for d in run_dirs:
        run = Path(d).resolve()
        if Path(d).is_dir() and (where == run or run in where.parents):
            what = "is" if where == run else "lies inside"
            problems.append(
                f"-o {out}: {what} the run directory {d} being compared; choose an -o outside "
                "the compared runs"
            )
    blocked = [str(f) for f in written if f.exists() and not f.is_file()]
    if blocked:
        problems.append(
            f"-o {out}: {', '.join(blocked)} {'is' if len(blocked) == 1 else 'are'} not a file "
            "(this compare writes a file there); move it away, or choose another -o"
        )
    taken = [] if force else [str(f) for f in written if f.is_file()]
    if taken:
        them = "them" if len(taken) > 1 else "it"
        problems.append(
            f"-o {out}: {', '.join(taken)} exist{'s' if len(taken) == 1 else ''} (an earlier "
            f"compare's output); pass --force to overwrite {them}, or choose another -o"
        )
    try:
        check_output_dir(out, "-o")
    except UserError as exc:
        problems.append(str(exc))
    return problems


def mixed_run_problems(run_dirs: list[str]) -> list[str]:
    """The run directories that hold events of several runs (see ``--allow-mixed``), as one
    problem ([] when none does)."""
    from nemo_jetrl.runs.logs import mixed_runs_message, run_ids

    mixed = [(d, ids) for d in run_dirs if Path(d).is_dir() and len(ids := run_ids(d)) > 1]
    if not mixed:
        return []
    return [
        "; ".join(f"{d}: {mixed_runs_message(ids)}" for d, ids in mixed)
        + ". Pass --allow-mixed to compare them anyway (labelled '[mixed: N runs]')"
    ]


def not_a_run_dir(run_dir: str | Path) -> str | None:
    """Why ``run_dir`` (an existing directory) is not a run directory, or None when it is one:
    `read_run` reads TensorBoard events anywhere under it and ``train_data_step*.jsonl`` in it,
    and it has neither. jsonl files deeper down are named (that directory is the run)."""
    from nemo_jetrl.runs.logs import EVENTS_GLOB, TRAIN_DATA_RE, train_data_files

    run_dir = Path(run_dir)
    if any(p.is_file() for p in run_dir.rglob(EVENTS_GLOB)) or train_data_files(run_dir):
        return None
    head = f"not a run directory: {run_dir}"
    deeper = sorted(
        {p.parent for p in run_dir.rglob("train_data_step*.jsonl") if TRAIN_DATA_RE.match(p.name)}
    )
    if not deeper:
        return f"{head} (no TensorBoard events or train_data_step*.jsonl under it)"
    more = f" and {len(deeper) - 3} more" if len(deeper) > 3 else ""
    return (
        f"{head} (no TensorBoard events under it; train_data_step*.jsonl only in "
        f"{', '.join(map(str, deeper[:3]))}{more}: pass that directory)"
    )


def unreadable_run(run: RunData) -> str | None:
    """Why no metric could be read from ``run``: not one scalar came from its files (TensorBoard
    events, or train_data jsonl to recompute from) and its read warnings name some of them
    (truncated, corrupt, not recomputable); None when it has a metric or nothing was said about
    its files (events with hparams only: the metric checks say it)."""
    from nemo_jetrl.runs.logs import find_event_files, train_data_files

    if run.scalars:
        return None
    dirs = run.parts or (run.path,)
    kinds = {
        "TensorBoard events": [str(f) for d in dirs for f in find_event_files(d)],
        "train_data_step*.jsonl": [str(f) for d in dirs for f in train_data_files(d).values()],
    }
    said = {k: [w for w in run.warnings if any(f in w for f in fs)] for k, fs in kinds.items()}
    if not any(said.values()):
        return None
    what = " and ".join(k for k, w in said.items() if w)
    return f"{run.path}: its {what} could not be read, so it has no metric: " + "; ".join(
        dict.fromkeys(w for ws in said.values() for w in ws)
    )


def metrics_no_run_has(summaries: Sequence[MetricSummary]) -> list[str]:
    """The requested metrics (in order) that resolved to a tag in none of the runs."""
    found: dict[str, bool] = {}
    for s in summaries:
        found[s.metric] = found.get(s.metric, False) or s.tag is not None
    return [m for m, f in found.items() if not f]


def close_tags(name: str, available: Iterable[str], n: int = 5) -> list[str]:
    """The tags among ``available`` whose full tag, last component or alias (`ALIASES`) reads
    like ``name`` (difflib ratio >= 0.6), closest first: what ``name`` was probably meant to be."""
    import difflib

    from nemo_jetrl.runs.report import ALIASES

    forms = {tag: {tag.lower(), tag.rsplit("/", 1)[-1].lower()} for tag in set(available)}
    for alias, tag in ALIASES.items():
        if tag in forms:
            forms[tag].add(alias)
    key = name.lower()
    score = {
        tag: max(difflib.SequenceMatcher(None, key, f).ratio() for f in fs)
        for tag, fs in forms.items()
    }
    return sorted((t for t, r in score.items() if r >= 0.6), key=lambda t: (-score[t], t))[:n]


def tags_hint(runs: Sequence[RunData], limit: int = 20) -> str:
    """The tags the runs have, sorted, at most ``limit`` of them ("none" when there are none)."""
    tags = sorted({t for r in runs for t in r.scalars})
    more = f" and {len(tags) - limit} more" if len(tags) > limit else ""
    return ", ".join(tags[:limit]) + more if tags else "none"


def unknown_metrics_message(metrics: Sequence[str], runs: Sequence[RunData]) -> str:
    """Why ``metrics`` (asked for by name, found in no run) are refused: each with its close
    tags, and the tags the runs have when nothing is close to one of them."""
    from nemo_jetrl.runs.report import ALIASES

    available = {t for r in runs for t in r.scalars}
    close = {m: close_tags(m, available) for m in metrics}
    msg = "; ".join(
        f"no run has metric {m!r} ({'close: ' + ', '.join(c) if c else 'nothing close'})"
        for m, c in close.items()
    )
    if not all(close.values()):
        msg += f"; tags found: {tags_hint(runs)}"
    return msg + (
        f". A metric is a full tag, a short name (chi2_token) or an alias ({', '.join(ALIASES)})"
    )
