"""`jetrl demo`'s one-page summary: learning over seeds and mismatch at its own resolution.

Four panels: validation accuracy per step (mean over the seeds every recipe ran, min-max band:
recipes run on fewer seeds are not drawn against a mean over more), each seed's gain with
the mean's 95% interval (what the "learns" claims test), and ``token_mult_prob_error - 1`` and
``gen_kl_error`` on log axes, so 1.00001 sits five decades below 1.01 instead of on the same
line. An exact 1 / exact 0 has no place on a log axis: such recipes are named in the panel as
``exact`` (on every step, or on how many) instead of silently missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nemo_jetrl._optional import require
from nemo_jetrl.commands._demo_report import (
    ACC,
    GEN_KL,
    MIN_SEEDS,
    TMPE,
    RecipeCurves,
    group,
    per_step_mean,
)
from nemo_jetrl.commands._demo_stats import t_interval

STYLES = ("-", "--", "-.", ":")


def exact_notes(runs: Sequence[RecipeCurves], tag: str, ideal: float) -> list[str]:
    """``recipe: exact on every step`` / ``exact on k of n steps`` for recipes with values
    equal to ``ideal`` (which a log axis cannot draw)."""
    notes = []
    for g in group(runs):
        vals = g.all_values(tag)
        k = sum(v == ideal for v in vals)
        if k == len(vals) and vals:
            notes.append(f"{g.recipe}: exactly {ideal:g} on every step")
        elif k:
            notes.append(f"{g.recipe}: exactly {ideal:g} on {k} of {len(vals)} steps")
    return notes


def _mismatch_panel(ax, runs: Sequence[RecipeCurves], tag: str, ideal: float) -> None:
    for i, g in enumerate(group(runs)):
        steps, ys = per_step_mean(g.runs, tag, ideal)
        pts = [(s, y) for s, y in zip(steps, ys, strict=True) if y > 0]
        if pts:
            xs, vs = zip(*pts, strict=True)
            ax.plot(xs, vs, STYLES[i % 4], color=f"C{i % 10}", marker="o", markersize=3,
                    label=g.recipe)  # fmt: skip
    ax.set_yscale("log")
    notes = exact_notes(runs, tag, ideal)
    if notes:
        # mid-height: the off-policy curves sit high, float64 rounding-level ones low
        ax.text(0.02, 0.5, "\n".join(notes), transform=ax.transAxes, fontsize=8, va="center",
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "0.7"})  # fmt: skip


def _gain_panel(ax, runs: Sequence[RecipeCurves]) -> None:
    groups = group(runs)
    for i, g in enumerate(groups):
        gains = g.gains()
        n = len(gains)
        xs = [i + (k - (n - 1) / 2) * 0.08 for k in range(n)]
        ax.plot(xs, gains, "o", color=f"C{i % 10}", alpha=0.6, markersize=4)
        if n >= MIN_SEEDS:  # 2 seeds' interval (t = 12.7) would only squash the axis
            iv = t_interval(gains)
            ax.errorbar([i + 0.3], [iv.mean], yerr=[[iv.mean - iv.lo], [iv.hi - iv.mean]],
                        fmt="s", color=f"C{i % 10}", capsize=4, markersize=5)  # fmt: skip
    ax.axhline(0.0, color="0.5", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [g.recipe for g in groups], fontsize=8)
    ax.set_xlim(-0.6, len(groups) - 0.2)


def same_seeds(runs: Sequence[RecipeCurves]) -> list[RecipeCurves]:
    """The runs of the GRPO seeds every recipe ran (the demo runs fp8_rollout and jetrl_kv on
    its first seeds only): a 2-seed mean beside an 8-seed one would compare seeds, not recipes."""
    seeds = [{r.seed for r in g.runs} for g in group(runs)]
    common = set.intersection(*seeds) if seeds else set()
    return [r for r in runs if r.seed in common]


def summary_page(runs: Sequence[RecipeCurves], path: str | Path, title: str = "") -> Path:
    """One PNG of the four panels described in the module docstring."""
    require("matplotlib", feature="the demo's summary plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(2, 2, 1)
    common = same_seeds(runs)
    for i, g in enumerate(group(common)):
        steps, mean = per_step_mean(g.runs, ACC, 0.0)
        lo = [min(r.curves[ACC][1][r.curves[ACC][0].index(s)] for r in g.runs) for s in steps]
        hi = [max(r.curves[ACC][1][r.curves[ACC][0].index(s)] for r in g.runs) for s in steps]
        ax.plot(steps, mean, STYLES[i % 4], color=f"C{i % 10}", marker="o", markersize=3,
                label=f"{g.recipe} ({len(g.runs)} seeds)")  # fmt: skip
        ax.fill_between(steps, lo, hi, color=f"C{i % 10}", alpha=0.12)
    n = len({r.seed for r in common})
    ax.set_title(f"validation accuracy (greedy): mean over the {n} seeds every recipe ran, "
                 "min-max band", fontsize=10)  # fmt: skip
    ax.set_xlabel("step")
    _gain_panel(ax2 := fig.add_subplot(2, 2, 2), runs)
    ax2.set_title(f"gain per seed (dots); mean, 95% interval if >= {MIN_SEEDS} seeds", fontsize=10)
    _mismatch_panel(ax3 := fig.add_subplot(2, 2, 3), runs, TMPE, 1.0)
    ax3.set_title("token_mult_prob_error - 1 (log; mean over seeds)", fontsize=10)
    _mismatch_panel(ax4 := fig.add_subplot(2, 2, 4), runs, GEN_KL, 0.0)
    ax4.set_title("gen_kl_error (log; mean over seeds)", fontsize=10)
    for a in (ax, ax3, ax4):
        a.set_xlabel("step")
        if a.get_legend_handles_labels()[0]:  # an empty legend() warns on the demo's screen
            a.legend(fontsize=8, frameon=False)
    for a in (ax, ax2, ax3, ax4):
        a.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
