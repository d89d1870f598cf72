"""Runs a script that compiles Triton kernels for sm_90 with Triton's own compiler (no GPU
needed) in a subprocess, and returns the JSON report it prints last. The sm_90 compile checks
(split-K GEMM, grouped MoE GEMM, invariant attention) share it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def compile_report(script: str, *, timeout: float = 900) -> object:
    """The last stdout line of ``python -c script`` (run in the repository, the compiler and not
    the interpreter, Triton's FP-fusion default made explicit), parsed as JSON."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
