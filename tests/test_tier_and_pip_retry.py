"""scripts/test.sh and the other shell scripts are valid bash; scripts/tier.sh's per-tier
wall-clock limit on real processes (timeouts, the kill after the grace, leftovers, Ctrl-C,
skipped tiers); the setup scripts' pip retry (scripts/pip_retry.sh). test.sh's own control flow:
tests/test_test_sh_environments.py and tests/test_test_sh_lanes.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from script_standin import REPO


def _run_tiers(tiers: str, tmp_path: Path, **env: str) -> tuple[list[str], float]:
    """Source scripts/tier.sh as test.sh does, run `tiers`; return the summary lines (then rc=N)."""
    script = (
        "set -euo pipefail; rc=0; summary=(); source scripts/tier.sh; "
        f'{tiers}; printf "%s\\n" "${{summary[@]}}"; echo "rc=$rc"'
    )
    t0 = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", script],
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=60,  # a regression that lets a leftover process hang the tier fails here
        check=True,
    )
    return done.stdout.strip().splitlines()[-3:], time.monotonic() - t0


@pytest.mark.parametrize("ci", ["true", ""])
def test_a_skipped_tier_fails_ci_and_is_a_summary_line_elsewhere(tmp_path: Path, ci: str) -> None:
    lines, _ = _run_tiers(
        "skipped_tiers", tmp_path, CI=ci, JETRL_SKIP_VLLM="1", JETRL_SKIP_MUTANTS="1",
        JETRL_SKIP_NEMO_RL="0",
    )  # fmt: skip
    if ci:
        assert lines == [
            "JETRL_SKIP_VLLM=1: not run, CI=true runs every tier; unset JETRL_SKIP_VLLM (exit 1)",
            "JETRL_SKIP_MUTANTS=1: not run, CI=true runs every tier; unset JETRL_SKIP_MUTANTS (exit 1)",
            "rc=1",
        ]
    else:
        assert lines[-3:] == [
            "JETRL_SKIP_VLLM=1: that tier was skipped",
            "JETRL_SKIP_MUTANTS=1: that tier was skipped",
            "rc=0",
        ]


def _alive(pid_file: Path) -> bool:
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed orphan may linger as a zombie until its new parent reaps it
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


@pytest.mark.parametrize(
    "script",
    [
        "scripts/test.sh",
        "scripts/tier.sh",
        "scripts/pip_retry.sh",
        "scripts/setup_env.sh",
        "scripts/setup_vllm_env.sh",
        "scripts/setup_nemo_rl_env.sh",
        "scripts/setup_trl_env.sh",
        "scripts/fetch_vllm_src.sh",
    ],
)
def test_scripts_are_valid_bash(script: str) -> None:
    subprocess.run(["bash", "-n", script], cwd=REPO, check=True)


def test_hung_tier_times_out_and_the_next_tier_still_runs(tmp_path: Path) -> None:
    lines, took = _run_tiers(
        'tier "hung" sleep 30; tier "fine" true', tmp_path, JETRL_TIER_TIMEOUT_S="2"
    )
    assert lines == [
        "hung: timed out after 2 s (exit 124)",
        "fine: no pytest summary (exit 0)",
        "rc=124",
    ]
    assert took < 20


def test_tier_deaf_to_sigint_is_killed_after_the_grace(tmp_path: Path) -> None:
    # bash ignoring SIGINT stands in for a test stuck in C code that never returns to Python
    lines, took = _run_tiers(
        'tier "deaf" bash -c \'trap "" INT; sleep 30\'',
        tmp_path,
        JETRL_TIER_TIMEOUT_S="2",
        JETRL_TIER_KILL_AFTER_S="1",
    )
    assert lines[-2:] == ["deaf: timed out after 2 s (exit 137)", "rc=137"]
    assert took < 20


def test_tier_kills_what_its_command_leaves_behind(tmp_path: Path) -> None:
    # The orphan ignores SIGINT and holds the tier's stdout: without the group kill, tee would
    # wait for it (300 s) and _run_tiers' 60 s timeout would fail the test.
    pid_file = tmp_path / "orphan.pid"
    lines, _ = _run_tiers(
        f'tier "leaky" bash -c \'(trap "" INT; exec sleep 300) & echo $! > {pid_file}\'',
        tmp_path,
    )
    assert lines[-2:] == ["leaky: no pytest summary (exit 0)", "rc=0"]
    assert not _alive(pid_file)


def test_ctrl_c_stops_the_tier_and_the_script(tmp_path: Path) -> None:
    # Ctrl-C signals the terminal's foreground group: test.sh, the pipeline's subshell and tee,
    # not the tier's own process group; the tier must still stop, and no later tier start.
    started = tmp_path / "started"
    script = (
        "set -euo pipefail; rc=0; summary=(); source scripts/tier.sh; "
        f'tier "slow" bash -c \'touch {started}; sleep 30\'; tier "next" true'
    )
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, standing in for the terminal's foreground group
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as at a terminal
    )
    deadline = time.monotonic() + 20
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # margin: the subshell sets its trap right after starting timeout
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, (out, err)
    assert "test.sh: slow interrupted (exit 130)" in err
    assert "next" not in out + err


def _pip_retry(
    tmp_path: Path, failures: int, attempts: str, wait: str = "0"
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """pip_retry with a stand-in interpreter that logs its arguments and fails `failures` times."""
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {calls}\n'
        f'[ "$(wc -l < {calls})" -gt {failures} ] || exit 7\n'
    )
    fake.chmod(0o755)
    done = subprocess.run(
        [
            "bash",
            "-c",
            f"set -euo pipefail; source scripts/pip_retry.sh; pip_retry {fake} download -d x torch",
        ],
        cwd=REPO,
        env={**os.environ, "JETRL_PIP_ATTEMPTS": attempts, "JETRL_PIP_RETRY_WAIT_S": wait},
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done, calls.read_text().splitlines() if calls.exists() else []


def test_pip_retry_repeats_a_failed_pip_until_it_succeeds(tmp_path: Path) -> None:
    done, calls = _pip_retry(tmp_path, failures=2, attempts="3")
    assert done.returncode == 0, done.stderr
    assert calls == ["-m pip --disable-pip-version-check download -d x torch"] * 3
    assert "attempt 2 of 3" in done.stderr


def test_pip_retry_gives_up_with_pips_exit_status(tmp_path: Path) -> None:
    done, calls = _pip_retry(tmp_path, failures=5, attempts="2")
    assert done.returncode == 7
    assert len(calls) == 2
    assert "pip download failed 2 time(s) (last exit 7); giving up" in done.stderr


@pytest.mark.parametrize(
    ("attempts", "wait"), [("abc", "0"), ("0", "0"), ("3", "-1"), ("2.5", "1")]
)
def test_pip_retry_refuses_bad_settings_before_running_pip(
    tmp_path: Path, attempts: str, wait: str
) -> None:
    done, calls = _pip_retry(tmp_path, failures=0, attempts=attempts, wait=wait)
    assert done.returncode == 2
    assert calls == []  # pip never ran
    assert "JETRL_PIP_ATTEMPTS" in done.stderr and "JETRL_PIP_RETRY_WAIT_S" in done.stderr


def _setup_failed(log: Path) -> str:
    p = subprocess.run(
        ["bash", "-c", 'set -euo pipefail; source scripts/tier.sh; setup_failed "$0"', str(log)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_a_failed_setup_is_named_by_pips_conflict_or_its_last_error(tmp_path: Path) -> None:
    """CI's report keeps the summary line, not the setup log: the cause must be in the line."""
    log = tmp_path / "setup.log"
    conflict = (
        "Processing ./torch-2.11.0-cp311-cp311-manylinux_2_28_x86_64.whl\n"
        "ERROR: Cannot install torch==2.11.0 because these package versions have conflicting"
        " dependencies.\n\nThe conflict is caused by:\n    torch 2.11.0 depends on filelock\n"
        "    The user requested (constraint) filelock==4.3.1\n\nTo fix this you could try to:\n"
        "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/\n"
    )
    log.write_text(conflict * 3)  # pip_retry's three attempts: named once
    assert _setup_failed(log) == (
        "environment setup failed: pip conflict: torch 2.11.0 depends on filelock; The user"
        f" requested (constraint) filelock==4.3.1 (log: {log})"
    )
    log.write_text("Collecting foo\nERROR: No matching distribution found for foo==9\nbye\n")
    assert _setup_failed(log) == (
        f"environment setup failed: ERROR: No matching distribution found for foo==9 (log: {log})"
    )
    traceback = (  # a setup script's sanity import: the exception is named, not the frames
        'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\n'
        "    raise ValueError('x')\nValueError: Either a revision or a version must be specified\n"
        "[setup_nemo_rl_env] sanity import failed\n"
    )
    log.write_text("ERROR: pip warned before\n" + traceback)
    assert _setup_failed(log) == (
        "environment setup failed: ValueError: Either a revision or a version must be specified"
        f" (log: {log})"
    )
    log.write_text(traceback.replace("ValueError", "importlib.metadata.PackageNotFoundError"))
    assert _setup_failed(log).startswith(
        "environment setup failed: importlib.metadata.PackageNotFoundError: Either a revision"
    )
    log.write_text("[setup_vllm_env] sanity: import vllm failed\n")
    assert _setup_failed(log) == f"environment setup failed (log: {log})"
    assert _setup_failed(tmp_path / "none.log") == (
        f"environment setup failed (log: {tmp_path / 'none.log'})"
    )
