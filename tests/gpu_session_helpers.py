"""What the device session's CPU tests share (tests/test_gpu_session_*.py): the repository's
paths to the session and gpu_check.sh scripts, a subprocess runner, and gpu_check.sh's module list.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SESSION = REPO / "benchmarks" / "gpu" / "device_session.sh"
GPU_CHECK = REPO / "scripts" / "gpu_check.sh"


def sh(*cmd, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def gpu_test_modules() -> list[str]:
    p = sh("bash", GPU_CHECK, "--list")
    assert p.returncode == 0, p.stderr
    return p.stdout.split()
