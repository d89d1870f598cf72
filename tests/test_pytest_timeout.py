"""pytest-timeout is configured (pyproject.toml): a hung test fails with its stack and the session
goes on to the next test (signal method), instead of hanging the tier until its wall-clock limit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

HANG = """
import time


def test_hangs():
    time.sleep(60)


def test_after_the_hang():
    assert True
"""


def test_a_hung_test_fails_with_its_stack_and_the_session_goes_on(tmp_path: Path) -> None:
    pytest.importorskip("pytest_timeout")
    (tmp_path / "test_hang.py").write_text(HANG)
    p = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            *("-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path)),
            *("-o", "timeout=3", str(tmp_path / "test_hang.py")),
        ],
        capture_output=True,
        text=True,
        timeout=50,  # the configured method must end the test, not this limit
    )
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "Timeout (>3.0s)" in out and "time.sleep(60)" in out, out
    assert "1 failed, 1 passed" in out, out


def test_the_configured_limit_is_below_the_tier_limit() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert 'timeout_method = "signal"' in text
    limit = int(text.split("\ntimeout = ", 1)[1].split()[0])
    assert 0 < limit < 1500  # scripts/tier.sh's default JETRL_TIER_TIMEOUT_S
