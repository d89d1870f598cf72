"""`jetrl demo`'s lead table, claims and one-page plots (demo_report, demo_study) on known curves."""

from __future__ import annotations

import math

import pytest

from nemo_jetrl.commands._demo_report import (
    ACC,
    GEN_KL,
    REWARD,
    TMPE,
    RecipeCurves,
    demo_checks,
    lead_table,
    summary_page,
)
from nemo_jetrl.commands._demo_study import study_plot, study_table

STEPS = (0, 4, 8)


def _recipe(name: str, acc: tuple[float, ...], tmpe: float, kl: float) -> RecipeCurves:
    return RecipeCurves(
        name,
        {
            ACC: (STEPS, acc),
            REWARD: ((1, 2), (0.2, 0.4)),
            TMPE: ((1, 2), (tmpe, tmpe)),
            GEN_KL: ((1, 2), (kl, kl)),
        },
    )


def test_lead_table_leads_with_accuracy_gain_and_mismatch():
    rs = [
        _recipe("bf16", (0.2, 0.4, 0.6), 1.0, 0.0),
        _recipe("fp8_rollout", (0.2, 0.3, 0.35), 1.003, 9e-5),
    ]
    lines = lead_table(rs).splitlines()
    assert lines[0].split()[:4] == ["recipe", "val", "acc", "first"]
    assert lines[2].split() == ["bf16", "0.200", "0.600", "+0.400", "1.000000", "0.000e+00"]
    assert lines[3].split() == ["fp8_rollout", "0.200", "0.350", "+0.150", "1.003000", "9.000e-05"]


def test_demo_checks_pass_and_fail_on_the_numbers():
    good = [
        _recipe("bf16", (0.2, 0.4, 0.6), 1.0, 0.0),
        _recipe("fp8_rollout", (0.2, 0.3, 0.5), 1.003, 9e-5),
        _recipe("jetrl", (0.2, 0.5, 0.55), 1.0, 0.0),
    ]
    res = demo_checks(good)
    assert [ok for ok, _ in res] == [True, True, True, True]
    bad = [
        _recipe("bf16", (0.2, 0.3, 0.44), 1.0, 0.0),  # gain 0.24 < 0.25
        _recipe("fp8_rollout", (0.2, 0.3, 0.5), 1.0, 0.0),  # no higher mismatch than jetrl
        _recipe("jetrl", (0.2, 0.5, 0.7), 1.0, 0.0),
    ]
    oks = [ok for ok, _ in demo_checks(bad)]
    assert oks == [False, True, False, False]  # bf16 gain, tracking 0.26 apart, mismatch


def test_summary_page_and_study_plot_write_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    rs = [
        _recipe("bf16", (0.2, 0.4, 0.6), 1.0, 0.0),
        _recipe("fp8_rollout", (0.2, 0.3, 0.5), 1.003, 9e-5),
    ]
    p = summary_page(rs, tmp_path / "s.png", title="t")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = {
        "fp8_rollout": {
            2: [{TMPE: 1.002, GEN_KL: 1e-4, ACC: 0.5}, {TMPE: 1.004, GEN_KL: 3e-4, ACC: 0.7}]
        },
        "jetrl": {2: [{TMPE: 1.0, GEN_KL: 0.0, ACC: 0.6}, {TMPE: 1.0, GEN_KL: 0.0, ACC: math.nan}]},
    }
    q = study_plot(results, tmp_path / "l.png")
    assert q.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = study_table(results).splitlines()
    assert rows[1].split()[:6] == ["2", "15", "fp8_rollout", "1.003000", "[1.002000,", "1.004000]"]
    assert "0.600 [0.600, 0.600]" in rows[2]  # the NaN seed is left out of the accuracy stats
