"""`jetrl demo [--seed N] [--n-seeds K]`: the end-to-end comparison on CPU (the README's main job).

Runs the same short GRPO job on the embedded local backend under the recipes ``bf16``,
``fp8_rollout`` (BF16 training + FP8 rollout with vLLM's own quantizer: off-policy), ``jetrl``
(unified FP8 flow) and ``jetrl_kv`` (jetrl + FP8 KV cache with on-policy KV), once per GRPO seed.
One run's validation gain depends on its seed more than on the recipe (0.0-0.6, issue 25), so
``--seed`` is a base seed: `nemo_jetrl.commands._demo_stats.derive_seeds` derives from it one
warm-start seed (the warm start every run shares, cached) and K GRPO seeds, and every claim is
computed over the K runs (`nemo_jetrl.commands._demo_report`: mean, sd and 95% interval of the
gain; paired differences; mismatch on every step, recomputed in float64 from the train data).
It prints per recipe the accuracy first -> last and the mismatch, the mean validation curve
(evaluated every `_val_period` steps), then the claims as measured ok / NOT MET lines; it
writes ``OUT/compare/summary.png`` (`nemo_jetrl.commands._demo_plot`), the full metric table
(``OUT/compare/table.txt``), summary.json/csv and one PNG per metric. Each run directory
(``OUT/runs/<recipe>/seed-<S>``) is a NeMo-RL-layout log dir that `jetrl compare` and
TensorBoard read.

The base config is the packaged ``local_base.yaml`` (same as examples/configs/local/base.yaml)
plus `DEMO_SETTINGS`; each recipe's keys come from `nemo_jetrl.config.recipe_to_config_updates`,
so the demo runs exactly what ``jetrl check`` would judge. ``--study length`` runs the
answer-length study of `nemo_jetrl.commands._demo_study` instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

NAME = "demo"
HELP = "Run bf16 / fp8_rollout / jetrl / jetrl_kv on the local CPU backend and compare them."

DEFAULT_RECIPES = ("bf16", "fp8_rollout", "jetrl", "jetrl_kv")
# Settings a recipe file adds beyond the Recipe itself (examples/configs/recipes/*.yaml):
# the off-policy recipe ships with NeMo-RL's importance-sampling correction on.
RECIPE_EXTRAS = {"fp8_rollout": {"loss_fn.use_importance_sampling_correction": True}}
DEFAULT_SEED = 42
DEFAULT_N_SEEDS = 8
MIN_SEEDS = 3  # the fewest seeds a learning claim's interval is computed over
# fp8_rollout's and jetrl_kv's claims are about every step (mismatch), not about learning, so
# they run on the first MISMATCH_SEEDS GRPO seeds only; bf16 and jetrl, whose learning the demo
# judges over seeds, run on all --n-seeds (time: docs/local_backend.md).
MISMATCH_ONLY = ("fp8_rollout", "jetrl_kv")
MISMATCH_SEEDS = 2
VAL_SIZE = 256
# What the demo changes in the base config, before --set: a demo has nothing to resume, and 256
# validation problems instead of 64 halve the accuracy's sampling noise (binomial sd 0.03
# instead of 0.06); they are evaluated VAL_INTERVALS + 1 times along the run (`_val_period`).
VAL_INTERVALS = 4
DEMO_SETTINGS = ("checkpointing.enabled=false", f"jetrl.local.task.val_size={VAL_SIZE}")
SEED_KEYS = ("grpo.seed", "jetrl.local.warmstart.seed")  # derived from --seed, never --set


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Mode-specific options default to None, so `_option_problems` can refuse one given to the
    # other mode (`MODE_OPTIONS`); their defaults are filled in there.
    parser.add_argument(
        "--out", default="jetrl_demo", help="output directory (default: %(default)s)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="GRPO steps per recipe (default: the base config's)"
    )
    parser.add_argument(
        "--recipes",
        default=None,
        help=f"comma-separated presets to run (default: {','.join(DEFAULT_RECIPES)})",
    )
    parser.add_argument(
        "--num-ops",
        type=int,
        default=None,
        help="arithmetic steps per problem (answer length 6*N+3 tokens; default: base config's)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override applied to every run (repeatable)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="base seed: the warm-start seed and the GRPO seeds are derived from it "
        f"(default: {DEFAULT_SEED})",
    )
    parser.add_argument(
        "--n-seeds",
        type=int,
        default=None,
        help="GRPO seeds for bf16 and jetrl, whose learning is judged over them; fp8_rollout "
        f"and jetrl_kv run on the first {MISMATCH_SEEDS}; at least {MIN_SEEDS} (default: "
        f"{DEFAULT_N_SEEDS})",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help=f"runs at once, one process each (default: {_default_jobs()}, at most 2 of this "
        "machine's CPUs)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--device",
        metavar="DEV",
        default=None,
        help="cpu, cuda or cuda:N: where every run computes (jetrl.local.device; default cpu)",
    )
    parser.add_argument(
        "--study",
        choices=("length",),
        default=None,
        help="instead of the comparison: 'length' runs fp8_rollout and jetrl over growing answer "
        "lengths (see --lengths, --seeds) and plots mismatch and accuracy against length",
    )
    parser.add_argument(
        "--lengths", default=None, help="--study length: num_ops values (default: 2,4,6,8)"
    )
    parser.add_argument(
        "--seeds", default=None, help="--study length: GRPO seeds (default: 42,43,44)"
    )


def _default_jobs() -> int:
    return min(2, os.cpu_count() or 1)


def base_config_path() -> Path:
    return Path(__file__).resolve().parents[1] / "backends" / "local" / "assets" / "local_base.yaml"


def recipe_config(recipe: str, out: Path, overrides: list[str]):
    """The full config of one demo run (base + recipe keys + overrides; the log dir defaults to
    ``OUT/runs/<recipe>``, a ``logger.log_dir=`` among ``overrides`` replaces it). Returns the
    raw config tree, for the local backend's door; unhinted because modules below the door do not
    name the raw tree's types (the ratchet in tests/config/test_settings_door.py)."""
    from nemo_jetrl.config import (
        apply_overrides,
        load_config,
        merge_updates,
        recipe_to_config_updates,
    )
    from nemo_jetrl.recipe import Recipe

    cfg = load_config(base_config_path())
    updates = recipe_to_config_updates(Recipe.preset(recipe))
    cfg = merge_updates(cfg, updates)
    cfg = merge_updates(cfg, RECIPE_EXTRAS.get(recipe, {}))
    run_dir = out / "runs" / recipe
    return apply_overrides(cfg, [f"logger.log_dir={run_dir}", *overrides])


def run(args: argparse.Namespace) -> int:
    """Every option and every run's config checked first (all problems in one exit 2), then the
    runs; Ctrl-C stops them all (exit 130, one line: what finished, what was cut)."""
    from nemo_jetrl.commands._demo_runs import Interrupted, claim_run_dirs
    from nemo_jetrl.commands._output import output_dir_problem
    from nemo_jetrl.errors import UserError, together
    from nemo_jetrl.runs.lock import RunDirLock

    problems = _option_problems(args)
    out = Path(args.out)
    overrides = list(args.set)
    overrides.insert(0, f"grpo.val_period={_val_period(_valid(args.steps))}")
    if _valid(args.steps) is not None:
        overrides.append(f"grpo.max_num_steps={args.steps}")
    if _valid(args.num_ops) is not None and args.study is None:
        overrides.append(f"jetrl.local.task.num_ops={args.num_ops}")
    if args.device is not None:
        from nemo_jetrl.backends.local.device import check_device_flag

        try:
            check_device_flag(args.device)
            overrides.append(f"++jetrl.local.device={args.device}")
        except UserError as exc:
            problems.append(str(exc))
    plan = _study_plan if args.study == "length" else _demo_plan
    # A bad --out is said once, before any config is built (each run's log dir lies under it).
    out_problem = output_dir_problem(out, "--out")
    problems += [out_problem] if out_problem else []
    runs, config_problems = plan(args, out, overrides, problems, build=not out_problem)
    problems += [p for p in dict.fromkeys(config_problems) if p not in problems]
    if problems:
        raise together(problems)
    # One demo per --out: it replaces its old runs there, so a second demo must not run beside it.
    lock = RunDirLock(f"demo-{os.getpid()}").acquire([("--out", out)])
    try:
        claim_run_dirs(out, [r.run_dir for r in runs])
        if args.study == "length":
            from nemo_jetrl.commands._demo_study import run_length_study

            run_length_study(out, runs, progress=not args.no_progress)
            return 0
        return _demo(args, out, overrides, runs)
    except Interrupted as exc:
        print(f"jetrl demo: interrupted: {exc}", file=sys.stderr, flush=True)
        return 130
    finally:
        lock.release()


# Options that apply to one mode only (None: the comparison, "length": the study).
MODE_OPTIONS = {
    None: (("--recipes", "recipes"), ("--seed", "seed"), ("--n-seeds", "n_seeds"),
           ("--jobs", "jobs")),
    "length": (("--lengths", "lengths"), ("--seeds", "seeds")),
}  # fmt: skip
# Keys the demo sets per run, never --set: each run's own directory under --out, and the seeds
# (the comparison derives both from --seed; the study takes the GRPO seeds from --seeds).
RUN_DIR_KEYS = ("logger.log_dir", "checkpointing.checkpoint_dir")


def _option_problems(args: argparse.Namespace) -> list[str]:
    """Every problem with the options (each naming its option), defaults filled into ``args``."""
    from nemo_jetrl.config import parse_override
    from nemo_jetrl.recipe import PRESET_NAMES

    problems = []
    for mode, options in MODE_OPTIONS.items():
        for flag, attr in options:
            if args.study != mode and getattr(args, attr) is not None:
                need = "--study length" if mode else "the comparison (no --study)"
                problems.append(f"{flag} applies only to {need}; drop it")
    if args.study is not None and args.num_ops is not None:
        problems.append("--num-ops does not apply to --study length (use --lengths)")
    args.recipes = args.recipes if args.recipes is not None else ",".join(DEFAULT_RECIPES)
    args.seed = DEFAULT_SEED if args.seed is None else args.seed
    args.n_seeds = DEFAULT_N_SEEDS if args.n_seeds is None else args.n_seeds
    args.jobs = _default_jobs() if args.jobs is None else args.jobs
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    bad = [r for r in recipes if r not in PRESET_NAMES]
    if bad or not recipes:
        problems.append(f"--recipes: unknown {bad or 'empty list'}; use {', '.join(PRESET_NAMES)}")
    twice = sorted({r for r in recipes if recipes.count(r) > 1})
    if twice:
        problems.append(f"--recipes: {', '.join(twice)} given twice; name each recipe once")
    args.recipe_list = list(dict.fromkeys(r for r in recipes if r in PRESET_NAMES))
    for flag, value in (("--steps", args.steps), ("--num-ops", args.num_ops)):
        if value is not None and value < 1:
            problems.append(f"{flag} must be >= 1, got {value}")
    if not 0 <= args.seed < 2**63:
        problems.append("--seed must be an integer in [0, 2**63)")
    if args.jobs < 1:
        problems.append("--jobs must be >= 1")
    if args.n_seeds < MIN_SEEDS:
        problems.append(
            f"--n-seeds must be >= {MIN_SEEDS} (a claim over seeds needs an interval), got "
            f"{args.n_seeds}"
        )
    for kv in args.set:
        try:
            key = parse_override(kv)[1]
        except ValueError:
            continue  # the config check names it
        owns = [k for k in (*RUN_DIR_KEYS, *SEED_KEYS) if k == key or k.startswith(key + ".")]
        if args.study is not None:
            owns = [k for k in owns if k != "jetrl.local.warmstart.seed"]  # study: 42 unless --set
        if not owns:
            continue
        if owns[0] in RUN_DIR_KEYS:
            problems.append(
                f"--set {kv}: the demo gives every run its own directory under --out "
                f"(OUT/runs/<recipe>/...); choose --out instead"
            )
        elif args.study is not None:
            problems.append(f"--set {kv}: the study takes its GRPO seeds from --seeds")
        else:
            problems.append(
                f"--set {kv}: the demo derives {' and '.join(SEED_KEYS)} from --seed; "
                "pass --seed N instead"
            )
    return problems


def _valid(n: int | None) -> int | None:
    """A --steps / --num-ops value the configs can be built with (a bad one is reported)."""
    return n if n is not None and n >= 1 else None


def _demo_plan(args, out: Path, overrides: list[str], problems: list[str], build: bool = True):
    """Every run of the comparison as a `Job`, and every problem of their configs (``build``
    False: none built, for a bad --out)."""
    from nemo_jetrl.commands._demo_runs import Job, checked_config
    from nemo_jetrl.commands._demo_stats import derive_seeds

    ok = 0 <= args.seed < 2**63 and args.n_seeds >= 1  # else reported, no seeds to check
    seeds = derive_seeds(args.seed, args.n_seeds) if ok else None
    args.derived_seeds = seeds
    jobs, found = [], []
    for k, seed in enumerate(seeds.grpo if seeds and build else ()):
        for recipe in [r for r in args.recipe_list if k < MISMATCH_SEEDS or r not in MISMATCH_ONLY]:
            run_dir = out / "runs" / recipe / f"seed-{seed}"
            keys = [f"grpo.seed={seed}", f"jetrl.local.warmstart.seed={seeds.warmstart}"]
            ov = [f"logger.log_dir={run_dir}", *DEMO_SETTINGS, *keys, *overrides]
            cfg, issues = checked_config(recipe_config, recipe, out, ov)
            found += issues
            jobs.append(Job(recipe, seed, run_dir, cfg))
    return jobs, found


def _study_plan(args, out: Path, overrides: list[str], problems: list[str], build: bool = True):
    """The study's runs and their configs' problems (``build`` False: --lengths and --seeds
    checked, no config built, for a bad --out)."""
    from nemo_jetrl.commands._demo_study import study_runs

    try:
        lengths = [int(x) for x in (args.lengths or "2,4,6,8").split(",") if x.strip()]
        seeds = [int(x) for x in (args.seeds or "42,43,44").split(",") if x.strip()]
    except ValueError:
        problems.append("--lengths and --seeds take comma-separated integers")
        return [], []
    if not lengths or not seeds or min(lengths) < 1 or min(seeds) < 0:
        problems.append("--lengths needs integers >= 1 and --seeds integers >= 0")
        return [], []
    return study_runs(out, lengths, seeds, overrides, recipe_config) if build else ([], [])


def _demo(args: argparse.Namespace, out: Path, overrides: list[str], jobs: list) -> int:
    import warnings

    from nemo_jetrl.commands._demo_plot import summary_page
    from nemo_jetrl.commands._demo_report import curve_lines, demo_checks, lead_table
    from nemo_jetrl.commands._demo_runs import cpu_seconds, curves_of, run_jobs
    from nemo_jetrl.runs.logs import RunDataWarning
    from nemo_jetrl.runs.report import compare_runs

    t0, c0, load0 = time.perf_counter(), cpu_seconds(), os.getloadavg()[0]
    seeds = args.derived_seeds
    per = {r: sum(j.recipe == r for j in jobs) for r in args.recipe_list}
    print(
        f"demo: base seed {seeds.base} -> warm start seed {seeds.warmstart} (shared by every "
        f"run), GRPO seeds {', '.join(map(str, seeds.grpo))}; {len(jobs)} runs: "
        + ", ".join(f"{r} x {n}" for r, n in per.items()),
        flush=True,
    )
    runs = run_jobs(jobs, workers=args.jobs, progress=not args.no_progress)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunDataWarning)
        cmp = compare_runs([d.job.run_dir for d in runs], out / "compare")
    curves = curves_of(runs, cmp.runs)
    page = summary_page(curves, out / "compare" / "summary.png", title=_title(seeds))
    (out / "compare" / "table.txt").write_text(cmp.table + "\n")
    print("\n" + lead_table(curves) + "\n")
    print("\n".join(curve_lines(curves)) + "\n")
    for ok, line in demo_checks(curves, val_size=_val_size(overrides)):
        print(f"[{'ok' if ok else 'NOT MET'}] {line}")
    for w in cmp.warnings:
        print(f"warning: {w}")
    print(f"\none-page summary: {page}")
    print(f"every metric of every run: {out / 'compare' / 'table.txt'}, per-metric plots and "
          f"summary.json/csv in {out / 'compare'}")  # fmt: skip
    print(
        f"demo finished in {time.perf_counter() - t0:.1f}s wall, "
        f"{cpu_seconds() - c0:.1f}s CPU (this process and its runs); "
        f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f} (other processes slow it down)"
    )
    return 0


def _val_period(steps: int | None) -> int:
    """Validation every ``period`` steps from step 0: the largest divisor of ``steps`` that
    still gives ``VAL_INTERVALS`` intervals (16 steps: 4, so 0/4/8/12/16), so the curve has
    several points and always ends at the last step, which the claims compare with step 0
    (a prime ``steps`` above 4 validates every step)."""
    if steps is None:
        from nemo_jetrl.config import load_config

        steps = int(load_config(base_config_path())["grpo"]["max_num_steps"])
    return max(
        d for d in range(1, steps + 1) if steps % d == 0 and (steps // d >= VAL_INTERVALS or d == 1)
    )


def _val_size(overrides: list[str]) -> int | None:
    """Validation problems per evaluation: the demo's, unless --set changed it (then unknown
    here without parsing it: the claim text leaves the number out)."""
    keys = [kv.split("=", 1)[0].lstrip("+") for kv in overrides]
    return None if "jetrl.local.task.val_size" in keys else VAL_SIZE


def _title(seeds) -> str:
    return (
        f"jetrl demo: learning and mismatch over {len(seeds.grpo)} GRPO seeds "
        f"(base seed {seeds.base}, warm start seed {seeds.warmstart})"
    )
