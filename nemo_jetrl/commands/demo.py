"""`jetrl demo [--out DIR] [--steps N]`: the end-to-end comparison on CPU (the README's main job).

Runs the same short GRPO job on the embedded local backend under the recipes ``bf16``,
``fp8_rollout`` (BF16 training + FP8 rollout with vLLM's own quantizer: off-policy), ``jetrl``
(unified FP8 flow) and ``jetrl_kv`` (jetrl + FP8 KV cache with on-policy KV), all from the same
cached warm start, then compares them (`nemo_jetrl.runs.report.compare_runs`). It prints first
what the demo is about (`nemo_jetrl.commands._demo_report`): per recipe the validation accuracy of
the first and last evaluation and the mean ``token_mult_prob_error`` / ``gen_kl_error``, then the
demo's claims as measured pass/fail lines, then the full metric table; it writes
``OUT/compare/summary.png`` (accuracy, reward and both mismatch metrics on one page),
summary.json/csv and one PNG per metric under ``OUT/compare``. Each run directory
(``OUT/runs/<recipe>``) is a NeMo-RL-layout log dir that `jetrl compare` and TensorBoard read.

The base config is the packaged ``local_base.yaml`` (same as examples/configs/local/base.yaml);
each recipe's keys come from `nemo_jetrl.config.recipe_to_config_updates`, so the demo runs
exactly what ``jetrl check`` would judge. ``--study length`` runs the answer-length study of
`nemo_jetrl.commands._demo_study` instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

NAME = "demo"
HELP = "Run bf16 / fp8_rollout / jetrl / jetrl_kv on the local CPU backend and compare them."

DEFAULT_RECIPES = ("bf16", "fp8_rollout", "jetrl", "jetrl_kv")
# Settings a recipe file adds beyond the Recipe itself (examples/configs/recipes/*.yaml):
# the off-policy recipe ships with NeMo-RL's importance-sampling correction on.
RECIPE_EXTRAS = {"fp8_rollout": {"loss_fn.use_importance_sampling_correction": True}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", default="jetrl_demo", help="output directory (default: %(default)s)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="GRPO steps per recipe (default: the base config's)"
    )
    parser.add_argument(
        "--recipes",
        default=",".join(DEFAULT_RECIPES),
        help="comma-separated presets to run (default: %(default)s)",
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
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--study",
        choices=("length",),
        default=None,
        help="instead of the comparison: 'length' runs fp8_rollout and jetrl over growing answer "
        "lengths (see --lengths, --seeds) and plots mismatch and accuracy against length",
    )
    parser.add_argument(
        "--lengths", default="2,4,6,8", help="--study length: num_ops values (default: %(default)s)"
    )
    parser.add_argument(
        "--seeds", default="42,43,44", help="--study length: GRPO seeds (default: %(default)s)"
    )


def base_config_path() -> Path:
    return Path(__file__).resolve().parents[1] / "backends" / "local" / "assets" / "local_base.yaml"


def recipe_config(recipe: str, out: Path, overrides: list[str]):
    """The full config of one demo run (base + recipe keys + overrides)."""
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
    from nemo_jetrl.errors import UserError
    from nemo_jetrl.recipe import PRESET_NAMES
    from nemo_jetrl.runs.lock import RunDirLock

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    bad = [r for r in recipes if r not in PRESET_NAMES]
    if bad or not recipes:
        raise UserError(f"--recipes: unknown {bad or 'empty list'}; use {', '.join(PRESET_NAMES)}")
    if args.steps is not None and args.steps < 1:
        raise UserError("--steps must be >= 1")
    out = Path(args.out)
    overrides = list(args.set)
    if args.steps is not None:
        overrides.append(f"grpo.max_num_steps={args.steps}")
    if args.num_ops is not None:
        overrides.append(f"jetrl.local.task.num_ops={args.num_ops}")
    # One demo per --out: it deletes its old runs there, so a second demo must not run beside it.
    lock = RunDirLock(f"demo-{os.getpid()}").acquire([("--out", out)])
    try:
        if args.study == "length":
            return _length_study(args, out, overrides)
        return _demo(args, out, overrides, recipes)
    finally:
        lock.release()


def _demo(args: argparse.Namespace, out: Path, overrides: list[str], recipes: list[str]) -> int:
    import warnings

    from nemo_jetrl.backends.local.loop import run_local
    from nemo_jetrl.commands._demo_report import (
        curves_from_runs,
        demo_checks,
        lead_table,
        summary_page,
    )
    from nemo_jetrl.config import ConfigError
    from nemo_jetrl.errors import UserError
    from nemo_jetrl.runs.logs import RunDataWarning
    from nemo_jetrl.runs.report import compare_runs

    t0, c0 = time.perf_counter(), time.process_time()
    run_dirs = []
    for recipe in recipes:
        try:
            cfg = recipe_config(recipe, out, overrides)
        except ConfigError as exc:
            raise UserError(str(exc)) from None
        run_dir = out / "runs" / recipe
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a demo run always starts fresh
        print(f"== {recipe}", flush=True)
        try:
            res = run_local(cfg, progress=not args.no_progress)
        except ConfigError as exc:
            raise UserError(str(exc)) from None
        last = res.history[-1]
        print(
            f"   {res.last_step} steps in {res.seconds:.1f}s: reward {last['train/reward']:.3f}, "
            f"token_mult_prob_error {last['train/token_mult_prob_error']:.6f}",
            flush=True,
        )
        run_dirs.append(run_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunDataWarning)
        cmp = compare_runs(run_dirs, out / "compare")
    recipes_seen = curves_from_runs(cmp.runs)
    page = summary_page(
        recipes_seen, out / "compare" / "summary.png", title="jetrl demo: learning and mismatch"
    )
    print("\n" + lead_table(recipes_seen) + "\n")
    for ok, line in demo_checks(recipes_seen):
        print(f"[{'ok' if ok else 'NOT MET'}] {line}")
    print("\nall metrics:\n" + cmp.table)
    for w in cmp.warnings:
        print(f"warning: {w}")
    print(f"\none-page summary: {page}")
    print(f"plots and summary: {out / 'compare'} ({len(cmp.plots)} per-metric plots)")
    print(
        f"demo finished in {time.perf_counter() - t0:.1f}s wall, "
        f"{time.process_time() - c0:.1f}s CPU (this process)"
    )
    return 0


def _length_study(args: argparse.Namespace, out: Path, overrides: list[str]) -> int:
    from nemo_jetrl.commands._demo_study import run_length_study
    from nemo_jetrl.config import ConfigError
    from nemo_jetrl.errors import UserError

    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        raise UserError("--lengths and --seeds take comma-separated integers") from None
    if not lengths or not seeds or min(lengths) < 1 or min(seeds) < 0:
        raise UserError("--lengths needs integers >= 1 and --seeds integers >= 0")
    if args.num_ops is not None:
        raise UserError("--num-ops does not apply to --study length (use --lengths)")
    if (out / "runs").exists():
        shutil.rmtree(out / "runs")  # a study always starts fresh
    try:
        run_length_study(
            out, lengths, seeds, overrides, progress=not args.no_progress,
            recipe_config=recipe_config,
        )  # fmt: skip
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    return 0
