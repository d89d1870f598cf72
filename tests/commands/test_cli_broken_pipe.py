"""`jetrl ... | head -1`: a reader that closes stdout early is not an error of the command.

Each command runs in a child Python whose stdout is a pipe whose reader is already gone (what
``head -1`` leaves once it has its line), so the child's first write to stdout fails with
EPIPE, deterministically. Before the fix the child printed a BrokenPipeError traceback and
exited 1, the off-policy verdict's code, whatever the config. Now it is silent and exits 141
(128 + SIGPIPE, what the shell reports for a tool that SIGPIPE ended: `nemo_jetrl.cli`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from test_compare import make_runs

from nemo_jetrl.cli import EXIT_BROKEN_PIPE
from nemo_jetrl.runs.logs import RunDataWarning

REPO = Path(__file__).resolve().parents[2]
QWEN = REPO / "examples" / "configs" / "qwen3_8b_base"


def jetrl(*args: str, reader_gone: bool, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python -m nemo_jetrl.cli ARGS``; with ``reader_gone`` its stdout is a pipe whose read
    end is closed before the child starts."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", None)  # check warns when it is set
    cmd = [sys.executable, "-m", "nemo_jetrl.cli", *args]
    if not reader_gone:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    r, w = os.pipe()
    os.close(r)  # the reader has read what it wanted and gone
    try:
        return subprocess.run(
            cmd, cwd=cwd, env=env, stdout=w, stderr=subprocess.PIPE, text=True, timeout=300
        )
    finally:
        os.close(w)


def assert_quiet_141(proc: subprocess.CompletedProcess, codes=(EXIT_BROKEN_PIPE,)) -> None:
    assert EXIT_BROKEN_PIPE == 141
    assert proc.returncode in codes, (proc.returncode, proc.stderr[-3000:])
    for noise in ("Traceback", "BrokenPipeError", "Exception ignored"):
        assert noise not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize(
    ("config", "verdict"), [("jetrl.yaml", 0), ("fp8_rollout.yaml", 1)], ids=["on", "off"]
)
@pytest.mark.parametrize("json_out", [False, True], ids=["text", "json"])
def test_check_into_a_closed_pipe_exits_141_without_traceback(config, verdict, json_out):
    args = ["check", str(QWEN / config), *(["--json"] if json_out else [])]
    # the control: read to the end, the verdict's own code
    full = jetrl(*args, reader_gone=False)
    assert full.returncode == verdict, full.stderr[-3000:]
    assert full.stdout.strip()
    # `jetrl check CONFIG | head -1`: never 1 (off-policy) for an on-policy config, no traceback
    assert_quiet_141(jetrl(*args, reader_gone=True))


def test_help_and_compare_into_a_closed_pipe_exit_141(tmp_path):
    # argparse's own printing ignores the failed write (OSError) and exits 0: quiet either way
    assert_quiet_141(jetrl("--help", reader_gone=True), codes=(0, EXIT_BROKEN_PIPE))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunDataWarning)
        a, b = make_runs(tmp_path)
    proc = jetrl("compare", str(a), str(b), "-o", str(tmp_path / "o"), "--no-plots",
                 reader_gone=True, cwd=tmp_path)  # fmt: skip
    assert_quiet_141(proc)


def test_bad_input_is_still_exit_2_when_the_reader_is_gone(tmp_path):
    # nothing reaches stdout: the error is the command's own (stderr), exit 2 as ever
    proc = jetrl("compare", str(tmp_path / "no_such_run"), reader_gone=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "run directory not found" in proc.stderr and "Traceback" not in proc.stderr


def test_a_broken_pipe_that_is_not_stdouts_is_the_commands_failure(monkeypatch):
    """A worker's pipe breaking is a real failure: it propagates (traceback, exit 1), it is not
    made a quiet 141; only stdout whose reader is gone is."""
    from nemo_jetrl import cli

    def worker_pipe_broke(argv):
        raise BrokenPipeError(32, "Broken pipe (a worker's)")

    monkeypatch.setattr(cli, "_main", worker_pipe_broke)
    r, w = os.pipe()
    with open(w, "w") as out:  # stdout: a pipe whose reader is still there
        monkeypatch.setattr(sys, "stdout", out)
        assert not cli._stdout_reader_gone()
        with pytest.raises(BrokenPipeError, match="worker"):
            cli.main(["check", "x.yaml"])
        os.close(r)  # now it is gone
        assert cli._stdout_reader_gone()
