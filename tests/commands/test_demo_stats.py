"""`jetrl demo`'s seeds, interval statistics and exact-aware number display (_demo_stats)."""

from __future__ import annotations

import math

import pytest

from nemo_jetrl.commands._demo_stats import (
    derive_seeds,
    fmt_nonneg,
    fmt_ratio,
    t_interval,
    t_quantile,
)


def _t_cdf(x: float, df: int, n: int = 4000) -> float:
    """Student-t CDF by Simpson's rule on [0, x] (independent of the quantile table)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def pdf(t: float) -> float:
        return c * (1 + t * t / df) ** (-(df + 1) / 2)

    h = x / n
    s = pdf(0) + pdf(x) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, n))
    return 0.5 + s * h / 3


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 15, 30, 31, 45, 100, 1000])
def test_t_quantile_is_the_975_point(df):
    # table (df <= 30) and the Cornish-Fisher tail (df > 30) both land on 0.975
    assert _t_cdf(t_quantile(df), df) == pytest.approx(0.975, abs=2e-4)


@pytest.mark.parametrize("df", [1, 2, 5, 7, 30, 31, 60, 1000])
def test_one_sided_t_quantile_is_the_95_point(df):
    assert _t_cdf(t_quantile(df, one_sided=True), df) == pytest.approx(0.95, abs=2e-4)


def test_t_interval_on_known_numbers():
    iv = t_interval([1.0, 2.0, 3.0, 4.0])
    assert iv.mean == 2.5 and iv.n == 4
    assert iv.sd == pytest.approx(math.sqrt(5 / 3))
    half = 3.182 * math.sqrt(5 / 3) / 2
    assert (iv.lo, iv.hi) == (pytest.approx(2.5 - half), pytest.approx(2.5 + half))
    assert "95% interval [+0.446, +4.554], 4 seeds" in iv.text()
    assert iv.lower == pytest.approx(2.5 - 2.353 * math.sqrt(5 / 3) / 2)  # one-sided, df 3
    assert iv.lo < iv.lower < iv.mean
    one = t_interval([0.3])
    assert one.lo == one.hi == 0.3 and "no interval" in one.text()
    with pytest.raises(ValueError):
        t_interval([0.1, math.nan])


def test_derive_seeds_deterministic_distinct_prefix_stable():
    a, b = derive_seeds(42, 6), derive_seeds(42, 6)
    assert a == b
    assert len(set(a.grpo)) == 6 and a.warmstart not in a.grpo
    assert all(0 <= s < 2**31 for s in (*a.grpo, a.warmstart))
    assert derive_seeds(42, 3).grpo == a.grpo[:3]  # more seeds extend, never redraw
    assert derive_seeds(42, 3).warmstart == a.warmstart
    c = derive_seeds(43, 6)
    assert c.warmstart != a.warmstart and not set(c.grpo) & set(a.grpo)
    # pinned: sha256-derived, so every machine and Python version runs the same demo
    assert (a.warmstart, a.grpo[0]) == (2074971845, 61045160)
    with pytest.raises(ValueError):
        derive_seeds(1, 0)


@pytest.mark.parametrize(
    ("x", "text"),
    [
        (1.0, "1 (exact)"),
        (1.00001, "1+1.0e-05"),
        (1.0 + 2**-52, "1+2.2e-16"),  # the next double above 1 is not exact
        (1.0 - 3e-9, "1-3.0e-09"),
        (1.005792, "1.005792"),
        (1.0002, "1.000200"),
        (math.inf, "inf"),
    ],
)
def test_fmt_ratio_shows_the_distance_from_one(x, text):
    assert fmt_ratio(x) == text


def test_fmt_nonneg_labels_only_exact_zero():
    assert fmt_nonneg(0.0) == "0 (exact)"
    assert fmt_nonneg(3.7e-17) == "3.70e-17"
    assert fmt_nonneg(2.7e-4) == "2.70e-04"
