"""`jetrl compare RUN_DIR... [-o OUT] [--metric ...]`: put NeMo-RL runs side by side.

Reads each run directory (TensorBoard scalars anywhere under it, train_data_step*.jsonl to
recompute missing mismatch metrics), labels each by the recipe / ``jetrl.run_name`` its logged
hyperparameters name, joins a job resumed across ``exp_NNN`` directories into one run
(``runs/resume.py``), prints a table per run and metric (last, mean, median, max, steps
covered), and writes summary.json / summary.csv and one PNG per metric into OUT.
Refused (exit 2) before anything is read: an OUT that is a file or cannot be created, and a
run directory holding the events of several runs (``--allow-mixed`` compares it, labelled).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
        help="metric tag or short name, repeatable or comma-separated (default: "
        "token_mult_prob_error, gen_kl_error, jetrl/mismatch/{k1_kl,chi2_token,is_ratio_mean}, "
        "reward, validation accuracy)",
    )
    parser.add_argument(
        "--format",
        choices=("json", "csv", "both"),
        default="both",
        help="machine-readable summary format (default: %(default)s)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
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

    from nemo_jetrl.errors import MissingDependencyError, UserError
    from nemo_jetrl.runs.logs import RunDataWarning
    from nemo_jetrl.runs.report import DEFAULT_METRICS, compare_runs

    missing = [d for d in args.run_dirs if not Path(d).is_dir()]
    if missing:
        raise UserError("run directory not found: " + ", ".join(missing))
    check_out_dir(Path(args.out))
    if not args.allow_mixed:
        check_single_runs(args.run_dirs)
    metrics = [m.strip() for arg in (args.metric or []) for m in arg.split(",") if m.strip()]
    formats = ("json", "csv") if args.format == "both" else (args.format,)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RunDataWarning)  # printed below, once
            res = compare_runs(
                args.run_dirs,
                args.out,
                metrics=metrics or list(DEFAULT_METRICS),
                formats=formats,
                plots=not args.no_plots,
                recompute=args.recompute,
            )
    except MissingDependencyError as exc:
        raise UserError(str(exc)) from None
    if all(s.tag is None for s in res.summaries):
        tags = sorted({t for r in res.runs for t in r.scalars})
        hint = ", ".join(tags[:20]) + (" ..." if len(tags) > 20 else "") if tags else "none"
        for m in res.warnings:
            print(f"warning: {m}", file=sys.stderr)
        raise UserError(f"none of the requested metrics was found in any run (tags found: {hint})")
    print(res.table)
    for m in res.warnings:
        print(f"warning: {m}", file=sys.stderr)
    for p in [*res.files, *res.plots]:
        print(f"wrote {p}")
    return 0


def check_out_dir(out: Path) -> None:
    """``-o`` must be a directory this process can create and write into; it is created before
    any run is read. An existing directory is reused: its summary files and plots are replaced."""
    from nemo_jetrl.commands._output import make_output_dir
    from nemo_jetrl.errors import UserError

    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out}: is an existing file, not a directory; choose another -o")
    make_output_dir(out, "-o")


def check_single_runs(run_dirs: list[str]) -> None:
    """Refuse run directories that hold events of several runs (see ``--allow-mixed``)."""
    from nemo_jetrl.errors import UserError
    from nemo_jetrl.runs.logs import mixed_runs_message, run_ids

    mixed = [(d, ids) for d in run_dirs if len(ids := run_ids(d)) > 1]
    if mixed:
        raise UserError(
            "; ".join(f"{d}: {mixed_runs_message(ids)}" for d, ids in mixed)
            + ". Pass --allow-mixed to compare them anyway (labelled '[mixed: N runs]')"
        )
