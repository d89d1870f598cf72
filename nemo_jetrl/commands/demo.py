"""`jetrl demo [--out DIR] [--steps N]`: the end-to-end comparison on CPU (the README's main job).

Runs the same short GRPO job on the embedded local backend under the recipes ``bf16``,
``fp8_rollout`` (BF16 training + FP8 rollout with vLLM's own quantizer: off-policy), ``jetrl``
(unified FP8 flow) and ``jetrl_kv`` (jetrl + FP8 KV cache with on-policy KV), all from the same
cached warm start, then compares them (`nemo_jetrl.runs.report.compare_runs`): prints the table of
``token_mult_prob_error``, ``gen_kl_error``, reward and validation accuracy, and writes
summary.json/csv and one PNG per metric under ``OUT/compare``. Each run directory
(``OUT/runs/<recipe>``) is a NeMo-RL-layout log dir that `jetrl compare` and TensorBoard read.

The base config is the packaged ``local_base.yaml`` (same as examples/configs/local/base.yaml);
each recipe's keys come from `nemo_jetrl.config.recipe_to_config_updates`, so the demo runs
exactly what ``jetrl check`` would judge.
"""

from __future__ import annotations

import argparse
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
    import warnings

    from nemo_jetrl.backends.local.loop import run_local
    from nemo_jetrl.config import ConfigError
    from nemo_jetrl.errors import UserError
    from nemo_jetrl.recipe import PRESET_NAMES
    from nemo_jetrl.runs.logs import RunDataWarning
    from nemo_jetrl.runs.report import compare_runs

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
    print()
    print(cmp.table)
    for w in cmp.warnings:
        print(f"warning: {w}")
    print(f"\nplots and summary: {out / 'compare'} ({len(cmp.plots)} plots)")
    print(
        f"demo finished in {time.perf_counter() - t0:.1f}s wall, "
        f"{time.process_time() - c0:.1f}s CPU (this process)"
    )
    return 0
