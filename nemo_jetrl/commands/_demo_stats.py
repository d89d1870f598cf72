"""The numbers behind `jetrl demo`'s claims: its seeds, intervals over seeds, exact-aware display.

One GRPO run of the demo's size gains anywhere from 0.0 to 0.6 validation accuracy depending on
its seed (issue 25), so the demo never judges one run: ``--seed N`` is a *base* seed from which
`derive_seeds` draws the warm-start seed and K GRPO seeds, and each claim is a statement about
the mean over those K runs: a directional claim ("learns", "as well as bf16") holds when the
one-sided 95% Student-t lower confidence bound (`Interval.lower`) clears its threshold; the
two-sided 95% interval is shown beside it (`t_interval`).

Mismatch is shown at the resolution where it exists: ``token_mult_prob_error`` of 1.00001 must
not print as ``1.000000``, and an exact 1 (the rollout's logprobs equal the trainer's bit for
bit) is labelled ``exact`` (`fmt_ratio`, `fmt_nonneg`).
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

SEED_LIMIT = 2**31  # derived seeds stay far below the config's 2**63 (the backend adds offsets)

# Two-sided 95% Student-t quantiles t_{0.975, df} for df = 1..30 (standard tables).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
_Z975 = 1.959964
# One-sided 95% quantiles t_{0.95, df} for df = 1..30 (standard tables).
_T95 = (
    6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
    1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
    1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697,
)  # fmt: skip
_Z95 = 1.644854


@dataclass(frozen=True)
class DemoSeeds:
    """The seeds one ``jetrl demo --seed BASE`` run uses."""

    base: int
    warmstart: int
    """``jetrl.local.warmstart.seed``: one warm start shared by every recipe and GRPO seed."""
    grpo: tuple[int, ...]
    """``grpo.seed`` of each repetition (data order, sampling, validation set)."""


def _draw(base: int, role: str, index: int) -> int:
    digest = hashlib.sha256(f"nemo-jetrl demo/{base}/{role}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % SEED_LIMIT


def derive_seeds(base: int, n: int) -> DemoSeeds:
    """The warm-start seed and ``n`` distinct GRPO seeds of base seed ``base``.

    sha256-based, so the same on every machine and Python; prefix-stable (the first K seeds of
    ``n = K + 1`` are those of ``n = K``), so more repetitions extend a demo instead of redrawing.
    """
    if n < 1:
        raise ValueError(f"need at least one GRPO seed, got {n}")
    seeds: list[int] = []
    i = 0
    while len(seeds) < n:
        s = _draw(base, "grpo", i)
        if s not in seeds:  # a 31-bit collision is astronomically rare, but never repeat a run
            seeds.append(s)
        i += 1
    return DemoSeeds(base=base, warmstart=_draw(base, "warmstart", 0), grpo=tuple(seeds))


def t_quantile(df: int, *, one_sided: bool = False) -> float:
    """Student-t quantile for ``df`` degrees of freedom (df >= 1): t_{0.975} (two-sided 95%),
    or t_{0.95} with ``one_sided`` (a 95% lower or upper bound)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    table, z = (_T95, _Z95) if one_sided else (_T975, _Z975)
    if df <= len(table):
        return table[df - 1]
    # Cornish-Fisher expansion beyond the table: error < 1e-3 for df > 30
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values with its sample sd, 95% t-interval ``[lo, hi]`` and one-sided 95%
    lower confidence bound ``lower`` (all equal to the mean when n = 1)."""

    mean: float
    sd: float
    lo: float
    hi: float
    n: int
    lower: float = math.nan

    def text(self, signed: bool = True) -> str:
        f = "{:+.3f}" if signed else "{:.3f}"
        if self.n < 2:
            return f"{f.format(self.mean)} (one seed: no interval)"
        return (
            f"{f.format(self.mean)} (sd {self.sd:.3f}, 95% interval "
            f"[{f.format(self.lo)}, {f.format(self.hi)}], {self.n} seeds)"
        )


def t_interval(values: Sequence[float]) -> Interval:
    """Mean, sd and two-sided 95% Student-t interval of ``values`` (NaNs are an error)."""
    vals = [float(v) for v in values]
    if not vals or not all(math.isfinite(v) for v in vals):
        raise ValueError(f"need finite values, got {vals}")
    m = statistics.fmean(vals)
    if len(vals) < 2:
        return Interval(m, math.nan, m, m, len(vals), m)
    sd = statistics.stdev(vals)
    se = sd / math.sqrt(len(vals))
    half = t_quantile(len(vals) - 1) * se
    lower = m - t_quantile(len(vals) - 1, one_sided=True) * se
    return Interval(m, sd, m - half, m + half, len(vals), lower)


def fmt_ratio(x: float) -> str:
    """A ratio whose ideal is 1 (``token_mult_prob_error``): ``1 (exact)`` only for exactly 1.0;
    otherwise enough digits that the distance from 1 shows (``1.005792``, ``1+1.0e-05``)."""
    if x == 1.0:
        return "1 (exact)"
    if not math.isfinite(x):
        return str(x)
    d = x - 1.0
    return f"{x:.6f}" if abs(d) >= 1e-4 else f"1{d:+.1e}"


def fmt_nonneg(x: float) -> str:
    """A divergence whose ideal is 0 (``gen_kl_error``): ``0 (exact)`` only for exactly 0.0."""
    if x == 0.0:
        return "0 (exact)"
    return f"{x:.2e}" if math.isfinite(x) else str(x)
