"""What `jetrl demo` shows: the lead table, the one-page summary plot and the demo's checks.

The demo answers two questions at once, so both lead: does GRPO learn (validation accuracy
first -> last evaluation, per recipe) and how far is each recipe's rollout from its trainer
(mean ``token_mult_prob_error``, ``gen_kl_error``). `lead_table` prints them first,
`summary_page` draws accuracy, reward and the two mismatch metrics on one PNG, and
`demo_checks` states the demo's claims (bf16 and jetrl learn, jetrl tracks bf16, fp8_rollout's
mismatch stays above jetrl's) as measured pass/fail lines.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nemo_jetrl._optional import require

ACC = "validation/accuracy"
REWARD = "train/reward"
TMPE = "train/token_mult_prob_error"
GEN_KL = "train/gen_kl_error"
MIN_GAIN = 0.25  # the demo's claim: validation accuracy rises by at least this much
TRACK_TOL = 0.15  # jetrl's last accuracy within this of bf16's counts as tracking it


@dataclass(frozen=True)
class RecipeCurves:
    """One recipe's curves (steps and values per metric) as the demo reads them."""

    recipe: str
    curves: dict[str, tuple[tuple[int, ...], tuple[float, ...]]]

    def series(self, tag: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
        return self.curves.get(tag, ((), ()))

    def first_last(self, tag: str) -> tuple[float, float]:
        _, v = self.series(tag)
        return (v[0], v[-1]) if v else (math.nan, math.nan)

    def mean(self, tag: str) -> float:
        _, v = self.series(tag)
        vals = [x for x in v if math.isfinite(x)]
        return statistics.fmean(vals) if vals else math.nan


def curves_from_runs(runs: Sequence) -> list[RecipeCurves]:
    """`RecipeCurves` from `nemo_jetrl.runs.logs.RunData` (as `compare_runs` returns them)."""
    out = []
    for run in runs:
        curves = {
            tag: (tuple(s.steps), tuple(s.values))
            for tag, s in run.scalars.items()
            if tag in (ACC, REWARD, TMPE, GEN_KL)
        }
        out.append(RecipeCurves(run.label, curves))
    return out


def lead_table(recipes: Sequence[RecipeCurves]) -> str:
    """Accuracy first -> last and mean mismatch per recipe, as aligned text."""
    head = ("recipe", "val acc first", "last", "gain", "token_mult_prob_error", "gen_kl_error")
    rows = [head]
    for r in recipes:
        a0, a1 = r.first_last(ACC)
        rows.append(
            (
                r.recipe,
                f"{a0:.3f}",
                f"{a1:.3f}",
                f"{a1 - a0:+.3f}",
                f"{r.mean(TMPE):.6f}",
                f"{r.mean(GEN_KL):.3e}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))) for row in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def demo_checks(recipes: Sequence[RecipeCurves]) -> list[tuple[bool, str]]:
    """(passed, statement) for each claim the demo makes whose recipes ran."""
    by = {r.recipe: r for r in recipes}
    out: list[tuple[bool, str]] = []
    for name in ("bf16", "jetrl"):
        if name in by:
            a0, a1 = by[name].first_last(ACC)
            out.append(
                (
                    a1 - a0 >= MIN_GAIN,
                    f"{name} learns: validation accuracy {a0:.3f} -> {a1:.3f} "
                    f"(gain {a1 - a0:+.3f}, claim >= +{MIN_GAIN})",
                )
            )
    if "bf16" in by and "jetrl" in by:
        b, j = by["bf16"].first_last(ACC)[1], by["jetrl"].first_last(ACC)[1]
        out.append(
            (
                abs(b - j) <= TRACK_TOL,
                f"jetrl tracks bf16: last accuracy {j:.3f} vs {b:.3f} (claim within {TRACK_TOL})",
            )
        )
    if "fp8_rollout" in by and "jetrl" in by:
        f, j = by["fp8_rollout"].mean(TMPE), by["jetrl"].mean(TMPE)
        out.append(
            (
                f > j,
                f"fp8_rollout is off-policy, jetrl is not: mean token_mult_prob_error "
                f"{f:.6f} > {j:.6f}",
            )
        )
    return out


def summary_page(recipes: Sequence[RecipeCurves], path: str | Path, title: str = "") -> Path:
    """One PNG: validation accuracy, train reward, token_mult_prob_error, gen_kl_error."""
    require("matplotlib", feature="the demo's summary plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7.5), dpi=100)
    FigureCanvasAgg(fig)
    panels = (
        (ACC, "validation accuracy (greedy)", False),
        (REWARD, "train reward", False),
        (TMPE, "token_mult_prob_error (1 = on-policy)", False),
        (GEN_KL, "gen_kl_error (log; 0 not drawn)", True),
    )
    styles = ("-", "--", "-.", ":")
    for k, (tag, label, logy) in enumerate(panels):
        ax = fig.add_subplot(2, 2, k + 1)
        for i, r in enumerate(recipes):
            steps, vals = r.series(tag)
            pts = [(s, v) for s, v in zip(steps, vals, strict=True) if math.isfinite(v)]
            if logy:
                pts = [(s, v) for s, v in pts if v > 0]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(
                    xs,
                    ys,
                    styles[i % 4],
                    color=f"C{i % 10}",
                    marker="o",
                    markersize=3,
                    label=r.recipe,
                )
        if logy:
            ax.set_yscale("log")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
