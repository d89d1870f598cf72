"""`jetrl demo --study length`: does the off-policy gap grow with the answer length?

For every answer length (``--lengths``: ``num_ops`` values, answer = 6 * num_ops + 3 tokens)
and every seed (``--seeds``), the same short GRPO job runs under ``fp8_rollout`` (vLLM's own FP8
quantizer at rollout, BF16 training: off-policy) and ``jetrl`` (unified FP8: on-policy). Each
length has its own warm start (a chain of N operations is a different task), shared by both
recipes and all seeds of that length (``jetrl.local.warmstart.seed`` is fixed), so at one length
the recipes differ only in precision flow and the seeds only in the GRPO data and sampling.

Per run it records the mean ``token_mult_prob_error`` and ``gen_kl_error`` over the steps and the
validation accuracy of the first and last evaluation; it prints one row per (length, recipe)
with the mean and range over seeds and draws the three quantities against the answer length on
one page (``OUT/study_length.png``, numbers in ``OUT/study_length.json``). Every run's config
is checked before the first one starts; each run logs to ``OUT/runs/<recipe>/ops<N>_seed<S>``.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_jetrl.commands._demo_report import ACC, GEN_KL, TMPE

STUDY_RECIPES = ("fp8_rollout", "jetrl")
QUANTITIES = (
    (TMPE, "mean token_mult_prob_error"),
    (GEN_KL, "mean gen_kl_error"),
    (ACC, "last validation accuracy"),
)


@dataclass(frozen=True)
class StudyRun:
    """One run of the study: recipe, answer length, GRPO seed, log dir and checked config."""

    recipe: str
    num_ops: int
    seed: int
    run_dir: Path
    cfg: Any


def study_runs(
    out: Path, lengths: list[int], seeds: list[int], overrides: list[str], recipe_config: Callable
) -> tuple[list[StudyRun], list[str]]:
    """Every run of the grid (log dir ``OUT/runs/<recipe>/ops<N>_seed<S>``) with its config
    built by ``recipe_config(recipe, out, overrides)`` (the demo's) and checked, and every
    problem found in them (`_demo_runs.checked_config`), before any of them runs."""
    from nemo_jetrl.commands._demo_runs import checked_config

    runs, problems = [], []
    for n in lengths:
        for seed in seeds:
            for recipe in STUDY_RECIPES:
                run_dir = out / "runs" / recipe / f"ops{n}_seed{seed}"
                ov = [
                    f"logger.log_dir={run_dir}",
                    f"jetrl.local.task.num_ops={n}",
                    f"grpo.seed={seed}",
                    "jetrl.local.warmstart.seed=42",
                    "checkpointing.enabled=false",
                    *overrides,
                ]
                cfg, found = checked_config(recipe_config, recipe, out, ov)
                runs.append(StudyRun(recipe, n, seed, run_dir, cfg))
                problems += found
    return runs, problems


def _run_one(run: StudyRun, progress: bool) -> dict:
    from nemo_jetrl.backends.local.loop import resolve_run, run_local

    res = run_local(resolve_run(run.cfg), progress=progress)
    hist = res.history
    accs = [h[ACC] for h in hist if ACC in h]
    return {
        TMPE: statistics.fmean(h[TMPE] for h in hist),
        GEN_KL: statistics.fmean(h[GEN_KL] for h in hist),
        ACC: accs[-1] if accs else math.nan,
        "seconds": res.seconds,
    }


def run_length_study(out: Path, runs: list[StudyRun], progress: bool) -> dict:
    """Run the grid (`study_runs`), print the table, write the JSON and the plot; returns the
    results."""
    results: dict[str, dict[int, list[dict]]] = {r: {} for r in STUDY_RECIPES}
    t0 = time.perf_counter()
    total = len(runs)
    for done, run in enumerate(runs, 1):
        print(f"== length study: num_ops={run.num_ops} ({6 * run.num_ops + 3} answer tokens), "
              f"seed {run.seed}, {run.recipe} [{done}/{total}]", flush=True)  # fmt: skip
        r = _run_one(run, progress)
        results[run.recipe].setdefault(run.num_ops, []).append(r)
        el = time.perf_counter() - t0
        print(f"   {r['seconds']:.0f}s; {el:.0f}s elapsed, ~{el / done * (total - done):.0f}s left",
              flush=True)  # fmt: skip
    print()
    print(study_table(results))
    (out / "study_length.json").write_text(json.dumps(results, indent=1))
    path = study_plot(results, out / "study_length.png")
    print(f"\nplot: {path}\nnumbers: {out / 'study_length.json'}")
    return results


def _stats(runs: list[dict], key: str) -> tuple[float, float, float]:
    vals = [r[key] for r in runs if math.isfinite(r[key])]
    if not vals:
        return math.nan, math.nan, math.nan
    return statistics.fmean(vals), min(vals), max(vals)


def study_table(results: dict[str, dict[int, list[dict]]]) -> str:
    """One row per (length, recipe): mean [min, max] over seeds of each quantity."""
    lines = [f"{'num_ops':>7} {'tokens':>6}  {'recipe':<12} {'token_mult_prob_error':>32}  "
             f"{'gen_kl_error':>30}  {'last val acc':>22}"]  # fmt: skip
    lengths = sorted({n for per in results.values() for n in per})
    for n in lengths:
        for recipe, per in results.items():
            if n not in per:
                continue
            cells = []
            for key, fmt in ((TMPE, "{:.6f}"), (GEN_KL, "{:.2e}"), (ACC, "{:.3f}")):
                m, lo, hi = _stats(per[n], key)
                cells.append(f"{fmt.format(m)} [{fmt.format(lo)}, {fmt.format(hi)}]")
            lines.append(f"{n:>7} {6 * n + 3:>6}  {recipe:<12} {cells[0]:>32}  {cells[1]:>30}  "
                         f"{cells[2]:>22}")  # fmt: skip
    return "\n".join(lines)


def study_plot(results: dict[str, dict[int, list[dict]]], path: Path) -> Path:
    """The three quantities against answer length: seed mean with a min-max band."""
    from nemo_jetrl._optional import require

    require("matplotlib", feature="the length study's plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    for k, (key, label) in enumerate(QUANTITIES):
        ax = fig.add_subplot(1, 3, k + 1)
        for recipe, per in results.items():
            ns = sorted(per)
            st = [_stats(per[n], key) for n in ns]
            toks = [6 * n + 3 for n in ns]
            ax.plot(toks, [s[0] for s in st], "-o", markersize=4, label=recipe)
            ax.fill_between(toks, [s[1] for s in st], [s[2] for s in st], alpha=0.2)
        if key == GEN_KL:
            ax.set_yscale("symlog", linthresh=1e-8)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("answer tokens (6 * num_ops + 3)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
