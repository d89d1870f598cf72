"""`jetrl demo` end to end: its options, and every claim ok on a base seed nobody tuned on."""

from __future__ import annotations

import json
import re

import pytest

from nemo_jetrl.cli import main

pytest.importorskip("transformers")


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(["demo", *argv])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--set", "grpo.seed=3"], "pass --seed N instead"),
        (["--set", "+jetrl.local.warmstart.seed=3"], "derives grpo.seed and"),
        (["--n-seeds", "2"], "--n-seeds must be >= 3"),
        (["--jobs", "0"], "--jobs must be >= 1"),
        (["--seed", "-1"], "--seed must be an integer"),
    ],
)
def test_demo_refuses_options_that_break_its_seeds(capsys, tmp_path, argv, needle):
    code, text = _run(capsys, "--out", str(tmp_path), *argv)
    assert code == 2 and needle in text
    assert not (tmp_path / "runs").exists()  # refused before any run


@pytest.mark.slow
def test_demo_claims_hold_on_an_untuned_seed(capsys, tmp_path, monkeypatch):
    """The whole default demo (bf16 and jetrl x 8 GRPO seeds, fp8_rollout and jetrl_kv x 2) on
    base seed 20251124, which no setting was chosen on: every claim ok (non-inferiority margin
    0.1), every run's validation curve evaluated at steps 0/4/8/12/16, nothing warned."""
    monkeypatch.setenv("JETRL_CACHE_DIR", str(tmp_path / "cache"))
    code, text = _run(capsys, "--out", str(tmp_path / "demo"), "--seed", "20251124",
                      "--no-progress")  # fmt: skip
    assert code == 0, text
    claims = re.findall(r"^\[(ok|NOT MET)\] (.*)$", text, flags=re.M)
    names = [c.split(":")[0] for _, c in claims]
    assert names == [
        "bf16 learns",
        "jetrl learns",
        "jetrl learns as well as bf16 (margin 0.1)",
        "fp8_rollout is off-policy",
        "jetrl is exactly on-policy",
        "jetrl_kv is exactly on-policy",
    ], text
    assert all(ok == "ok" for ok, _ in claims), text
    assert not re.search(r"warning|deprecat", text, flags=re.I), text
    summaries = json.loads((tmp_path / "demo" / "compare" / "summary.json").read_text())
    val = [s for s in summaries["summaries"] if s["metric"] == "validation/accuracy"]
    assert len(val) == 20  # 8 + 2 + 8 + 2 runs
    assert all((s["steps"], s["first_step"], s["last_step"]) == (5, 0, 16) for s in val), val
    assert re.search(r"^jetrl \(8 seeds\), mean validation accuracy at step 0: .*, 16: ", text,
                     flags=re.M), text  # fmt: skip


def test_validation_is_a_curve_that_ends_at_the_last_step():
    """Issue 37: summary.png's validation curve had two points (first and last step)."""
    from nemo_jetrl.commands.demo import VAL_INTERVALS, _val_period

    assert [_val_period(n) for n in (16, 20, 12, 18, 7, 3)] == [4, 5, 3, 3, 1, 1]
    assert _val_period(None) == 4  # the base config's 16 steps: 0/4/8/12/16
    for n in range(1, 130):
        p = _val_period(n)
        assert n % p == 0 and (n // p >= VAL_INTERVALS or p == 1), n
