"""The rows `jetrl check` prints: the flow per layer group, training forward vs rollout."""

from __future__ import annotations

from nemo_jetrl.arch.linear import GROUPS
from nemo_jetrl.flow.check import FlowCheck, format_ranges
from nemo_jetrl.flow.graph import BF16, Precision, same_numbers

ORDER = ("embed", "kv", *GROUPS)
"""Edge groups in the order `jetrl check` prints them."""


def flow_table(check: FlowCheck) -> list[tuple[str, str, str, str, str]]:
    """Rows (layers, group, training forward, rollout, status), consecutive layers merged.

    A cell describes all edges of the group in that layer (weights and inputs of attn or mlp
    linears, K and V for kv); status is "same" when every rollout edge equals its training one.
    """
    fwd = check.train_fwd.by_key()
    per: dict[tuple[int | None, str], dict[str, list]] = {}
    for e in check.rollout.edges:
        t = fwd.get(e.key)
        d = per.setdefault((e.layer, e.group), {"t": [], "r": [], "same": []})
        d["t"].append((e.role, t.precision if t else BF16))
        d["r"].append((e.role, e.precision))
        d["same"].append(t is not None and same_numbers(t.precision, e.precision))
    cells = {k: (cell_text(d["t"]), cell_text(d["r"]), all(d["same"])) for k, d in per.items()}
    rows: list[tuple[str, str, str, str, str]] = []
    for grp in [*ORDER, *sorted({g for _, g in cells} - set(ORDER))]:
        items = sorted(
            ((lay, v) for (lay, g), v in cells.items() if g == grp),
            key=lambda kv: -1 if kv[0] is None else kv[0],
        )
        run: list[int] = []
        last = None
        for lay, v in items:
            if lay is None:
                rows.append(("-", grp, v[0], v[1], "same" if v[2] else "DIFFERS"))
                continue
            if last is not None and v != last:
                rows.append(_row(run, grp, last))
                run = []
            run.append(lay)
            last = v
        if run and last is not None:
            rows.append(_row(run, grp, last))
    return rows


def _row(layers: list[int], grp: str, v: tuple[str, str, bool]) -> tuple[str, str, str, str, str]:
    return (format_ranges(layers), grp, v[0], v[1], "same" if v[2] else "DIFFERS")


def cell_text(edges: list[tuple[str, Precision]]) -> str:
    """One cell: the precisions of a group's edges, compactly."""
    fp8 = [(role, p) for role, p in edges if p.is_fp8]
    if not fp8:
        return "BF16"
    if len(fp8) < len(edges):
        # Some linears of the group FP8, others BF16 (unaligned or named BF16 ones).
        return "mixed: " + cell_text(fp8) + " + BF16"
    p0 = fp8[0][1]
    if p0.block is None:
        return f"FP8 {p0.fmt} per-tensor {p0.scale} ({p0.impl})"
    scales = dict.fromkeys(p.scale for _, p in fp8)
    impls = dict.fromkeys(p.impl for _, p in fp8)
    fmts = dict.fromkeys(p.fmt for _, p in fp8)
    if len(scales) == 1:
        scale = p0.scale
    else:
        parts = {f"{'w' if r == 'weight' else 'x'} {p.scale}": None for r, p in fp8}
        scale = "/".join(parts)
    return f"FP8 {'/'.join(fmts)} {scale} ({'/'.join(impls)})"
