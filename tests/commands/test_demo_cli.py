"""`jetrl demo` end to end: its options, and every claim ok on a base seed nobody tuned on."""

from __future__ import annotations

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
    """The whole default demo (bf16 and jetrl x 6 GRPO seeds, fp8_rollout and jetrl_kv x 2) on
    base seed 20251124, which no setting was chosen on: every claim ok, nothing warned."""
    monkeypatch.setenv("JETRL_CACHE_DIR", str(tmp_path / "cache"))
    code, text = _run(capsys, "--out", str(tmp_path / "demo"), "--seed", "20251124",
                      "--no-progress")  # fmt: skip
    assert code == 0, text
    claims = re.findall(r"^\[(ok|NOT MET)\] (.*)$", text, flags=re.M)
    names = [c.split(":")[0] for _, c in claims]
    assert names == [
        "bf16 learns",
        "jetrl learns",
        "jetrl learns as well as bf16 (margin 0.25)",
        "fp8_rollout is off-policy",
        "jetrl is exactly on-policy",
        "jetrl_kv is exactly on-policy",
    ], text
    assert all(ok == "ok" for ok, _ in claims), text
    assert not re.search(r"warning|deprecat", text, flags=re.I), text
