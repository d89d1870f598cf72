"""scripts/test.sh: valid bash, its per-tier wall-clock limit (scripts/tier.sh) on real processes,
and the setup scripts' pip retry (scripts/pip_retry.sh)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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


# -- scripts/test.sh's control flow, on a stand-in repository ---------------------------------
# test.sh and tier.sh are the real scripts; every program they start (setup scripts, pytest, the
# tier scripts) is a labelled stand-in that logs "start NAME" / "end NAME" to a journal, so the
# order, the overlap of environment builds with the default suite and the summary are observable.
_STANDIN = """#!/usr/bin/env bash
# stand-in for {name} (tests/test_test_script.py)
echo "start {name} $* ${{VLLM_VENV:-}}" >> "$JOURNAL"
echo "$$" >> "$JOURNAL.pids"
sleep "${{STANDIN_SLEEP_{key}:-0}}"
echo "end {name} ${{VLLM_VENV:-}}" >> "$JOURNAL"
{tail}
"""


def _standin_repo(tmp_path: Path, fail: str = "") -> Path:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("test.sh", "tier.sh", "nemo_rl_env.sh"):
        (root / "scripts" / name).write_text((REPO / "scripts" / name).read_text())
    tails = {
        "setup_env": "",
        "setup_vllm_env": 'echo "setup $VLLM_VERSION failed" >&2; [ "$VLLM_VERSION" != "{f}" ]',
        "fetch_vllm_src": "",
        "setup_nemo_rl_env": "",
        "test_vllm": 'echo "== 3 passed in 1s =="',
        "test_nemo_rl": 'echo "== 2 passed in 1s =="',
    }
    for name, tail in tails.items():
        p = root / "scripts" / f"{name}.sh"
        p.write_text(_STANDIN.format(name=name, key=name.upper(), tail=tail.format(f=fail)))
    py = root / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(_STANDIN.format(name="default-python", key="PY", tail='echo "== 5 passed =="'))
    py.chmod(0o755)
    for tree in ("v0.7.0", "main-abc"):
        (tmp_path / "upstream" / tree / "nemo_rl").mkdir(parents=True)
    return root


def _test_sh_env(tmp_path: Path, **env: str) -> dict[str, str]:
    """test.sh's environment in a stand-in run: temp files, journal (``tmp_path / "journal"``)
    and the stand-in upstream trees under ``tmp_path``, then ``env``."""
    # the caller's own tier knobs (e.g. `JETRL_SKIP_VLLM=1 bash scripts/test.sh`) stay out
    mine = ("JETRL_SKIP_", "JETRL_TIER_", "JETRL_TEST_WORKERS", "JETRL_VLLM_VERSIONS")
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(mine)},
        "TMPDIR": str(tmp_path),
        "JOURNAL": str(tmp_path / "journal"),
        "JETRL_NEMO_RL_UPSTREAM": str(tmp_path / "upstream"),
        **env,
    }


def _run_test_sh(tmp_path: Path, fail: str = "", **env: str) -> tuple[list[str], list[str], str]:
    root = tmp_path / "repo" if (tmp_path / "repo").is_dir() else _standin_repo(tmp_path, fail)
    journal = tmp_path / "journal"
    done = subprocess.run(
        ["bash", "scripts/test.sh"],
        cwd=root,
        env=_test_sh_env(
            tmp_path, **{"JETRL_NEMO_RL_TREES": "v0.7.0 main-abc", "CI": "true", **env}
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    summary = done.stdout.split("== summary ==\n", 1)[1].splitlines()
    return summary, journal.read_text().splitlines(), done.stdout + done.stderr


def test_environments_build_while_the_default_suite_runs_and_each_tier_waits_for_its_own(
    tmp_path: Path,
) -> None:
    summary, journal, out = _run_test_sh(
        tmp_path, STANDIN_SLEEP_PY="3", STANDIN_SLEEP_SETUP_VLLM_ENV="0.5"
    )
    assert summary == [
        "default suite (.venv): 5 passed (exit 0)",
        "vLLM 0.32.0 tier (.venv-vllm): 3 passed in 1s (exit 0)",
        "vLLM 0.20.0 tier (.venv-vllm020): 3 passed in 1s (exit 0)",
        "NeMo-RL v0.7.0 tier: 2 passed in 1s (exit 0)",
        "NeMo-RL main-abc tier: 2 passed in 1s (exit 0)",
        "mutation check: 5 passed (exit 0)",
    ], out
    # each tier says how busy the whole machine was while it ran, on every core (not nproc's
    # answer, which follows the OMP_NUM_THREADS=1 every tier runs under)
    for name in ("default suite \\(\\.venv\\)", "NeMo-RL v0.7.0 tier", "NeMo-RL main-abc tier"):
        busy = re.search(rf"^\[tier\] {name}: \d+ s wall, machine CPU busy (\d+)% of (\d+) cores$",
                         out, re.M)  # fmt: skip
        assert busy and 0 <= int(busy[1]) <= 100 and int(busy[2]) == os.cpu_count(), (name, out)
    builds = [ln.split()[1] for ln in journal if ln.startswith("start ") and "setup" in ln]
    builds = [b for b in builds if b != "setup_env"]  # .venv: made first, in the foreground
    # each environment once, in the order of the tiers (0.32 and its source, 0.20, the trees)
    assert builds == ["setup_vllm_env", "setup_vllm_env", "setup_nemo_rl_env", "setup_nemo_rl_env"]
    assert _at(journal, "start fetch_vllm_src") < _at(journal, "start setup_vllm_env")
    # built while the default suite runs; each tier starts once its own environment is built
    assert _at(journal, "start setup_vllm_env") < _at(journal, "end default-python")
    assert _at(journal, "end setup_vllm_env") < _at(journal, "start test_vllm")
    assert _at(journal, "end setup_nemo_rl_env") < _at(journal, "start test_nemo_rl")


def _at(journal: list[str], prefix: str) -> int:
    """Index of the first journal line starting with ``prefix``."""
    return next(i for i, ln in enumerate(journal) if ln.startswith(prefix))


def test_a_failed_environment_is_its_tier_not_run_and_the_others_still_run(
    tmp_path: Path,
) -> None:
    summary, journal, out = _run_test_sh(tmp_path, fail="0.20.0")
    log = tmp_path / "jetrl-vllm-setup-0.20.0.log"
    assert summary == [
        "default suite (.venv): 5 passed (exit 0)",
        "vLLM 0.32.0 tier (.venv-vllm): 3 passed in 1s (exit 0)",
        f"vLLM 0.20.0 tier (.venv-vllm020): not run, environment setup failed (log: {log}) (exit 1)",
        "NeMo-RL v0.7.0 tier: 2 passed in 1s (exit 0)",
        "NeMo-RL main-abc tier: 2 passed in 1s (exit 0)",
        "mutation check: 5 passed (exit 0)",
    ], out
    assert "setup 0.20.0 failed" in out  # the setup log's tail is shown above the summary
    assert sum(ln.startswith("start test_vllm") for ln in journal) == 1


def test_skipped_tiers_build_no_environment_and_still_fail_ci(tmp_path: Path) -> None:
    summary, journal, _ = _run_test_sh(tmp_path, JETRL_SKIP_VLLM="1", JETRL_SKIP_NEMO_RL="1")
    assert not [ln for ln in journal if "setup_vllm_env" in ln or "setup_nemo_rl_env" in ln]
    assert summary[-2:] == [
        "JETRL_SKIP_VLLM=1: not run, CI=true runs every tier; unset JETRL_SKIP_VLLM (exit 1)",
        "JETRL_SKIP_NEMO_RL=1: not run, CI=true runs every tier; unset JETRL_SKIP_NEMO_RL (exit 1)",
    ]


def _interrupt_once_started(tmp_path: Path, started: str, **env: str) -> tuple[int, str]:
    """Run the stand-in repo's scripts/test.sh (journal at ``tmp_path / "journal"``, ``env``
    added), interrupt its process group (SIGINT, as Ctrl-C does) once the journal shows
    ``started``; (exit status, stdout + stderr)."""
    root = _standin_repo(tmp_path)
    journal = tmp_path / "journal"
    proc = subprocess.Popen(
        ["bash", "scripts/test.sh"],
        cwd=root,
        env=_test_sh_env(tmp_path, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and started not in (
        journal.read_text() if journal.exists() else ""
    ):
        time.sleep(0.05)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    return proc.returncode, out + err


def test_an_interrupted_run_ends_its_background_builds(tmp_path: Path) -> None:
    returncode, _ = _interrupt_once_started(
        tmp_path, "start default-python", STANDIN_SLEEP_PY="30", STANDIN_SLEEP_FETCH_VLLM_SRC="30"
    )
    assert returncode == 130
    journal = tmp_path / "journal"
    time.sleep(0.5)
    lines = journal.read_text().splitlines()
    assert any(ln.startswith("start fetch_vllm_src ") for ln in lines)
    # the 30 s build was ended, not left running
    assert not any(ln.startswith("end fetch_vllm_src") for ln in lines)
    assert not any(ln.startswith("start setup_vllm_env") for ln in lines)


def test_the_second_lane_runs_beside_the_first_and_the_summary_keeps_tier_order(
    tmp_path: Path,
) -> None:
    summary, journal, out = _run_test_sh(
        tmp_path, STANDIN_SLEEP_PY="2", STANDIN_SLEEP_TEST_VLLM="2", JETRL_TIER_LANES="2"
    )
    assert summary[1:3] == [
        "vLLM 0.32.0 tier (.venv-vllm): 3 passed in 1s (exit 0)",
        "vLLM 0.20.0 tier (.venv-vllm020): 3 passed in 1s (exit 0)",
    ], out
    # 0.20 (second lane) starts before 0.32 (first lane, after the default suite) ends
    i20 = _at(journal, "start test_vllm --runslow .venv-vllm020")
    assert i20 < journal.index("end test_vllm .venv-vllm")
    assert "== second lane's output (it ran beside the tiers above) ==" in out
    # one lane: one tier at a time, in summary order
    summary1, journal1, _ = _run_test_sh(tmp_path / "one", JETRL_TIER_LANES="1")
    assert summary1 == summary
    tiers = [ln.split()[1:4] for ln in journal1 if ln.startswith(("start test_", "end test_"))]
    assert [t[0] for t in tiers] == ["test_vllm", "test_vllm", "test_vllm", "test_vllm"] + [
        "test_nemo_rl"
    ] * 4
    root = _standin_repo(tmp_path / "bad")
    done = subprocess.run(
        ["bash", "scripts/test.sh"],
        cwd=root,
        env={**os.environ, "JOURNAL": str(tmp_path / "j"), "JETRL_TIER_LANES": "3"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "JETRL_TIER_LANES=3: use nemo-rl" in done.stderr
    env = {**os.environ, "JOURNAL": str(tmp_path / "j2"), "JETRL_TEST_WORKERS": "two"}
    done = subprocess.run(
        ["bash", "scripts/test.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "JETRL_TEST_WORKERS=two: use a whole number" in done.stderr
    assert not (tmp_path / "j2").exists()  # nothing started, not even the setup


def test_by_default_the_nemo_rl_trees_run_side_by_side_and_the_rest_one_at_a_time(
    tmp_path: Path,
) -> None:
    summary, journal, out = _run_test_sh(
        tmp_path, STANDIN_SLEEP_TEST_VLLM="1", STANDIN_SLEEP_TEST_NEMO_RL="2"
    )
    assert summary[3:] == [
        "NeMo-RL v0.7.0 tier: 2 passed in 1s (exit 0)",
        "NeMo-RL main-abc tier: 2 passed in 1s (exit 0)",
        "mutation check: 5 passed (exit 0)",
    ], out
    tiers = [ln.split()[:2] for ln in journal if ln.startswith(("start test_", "end test_"))]
    # the vLLM tiers one after the other, then both trees at once, the mutation check after them
    assert tiers == [["start", "test_vllm"], ["end", "test_vllm"]] * 2 + [
        ["start", "test_nemo_rl"], ["start", "test_nemo_rl"],
        ["end", "test_nemo_rl"], ["end", "test_nemo_rl"],
    ], journal  # fmt: skip
    assert _at(journal, "start default-python scripts/mutation_check.py") > max(
        i for i, ln in enumerate(journal) if ln.startswith("end test_nemo_rl")
    )
    assert "second lane: nemo_rl_tier main-abc; " in out


def test_an_interrupted_run_ends_the_second_lanes_tier(tmp_path: Path) -> None:
    returncode, output = _interrupt_once_started(
        tmp_path,
        "start test_vllm",
        STANDIN_SLEEP_PY="30",
        STANDIN_SLEEP_TEST_VLLM="30",
        JETRL_TIER_LANES="2",
    )
    assert returncode == 130, output
    journal = tmp_path / "journal"
    time.sleep(1)
    lines = journal.read_text().splitlines()
    assert any(ln.startswith("start test_vllm --runslow .venv-vllm020") for ln in lines)
    assert not any(ln.startswith(("end test_vllm", "end default-python")) for ln in lines)
    for pid in map(int, (tmp_path / "journal.pids").read_text().split()):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert stat == "Z", f"stand-in {pid} still running after the interrupt"


def test_an_environment_that_imports_vllm_is_not_rebuilt(tmp_path: Path) -> None:
    root = _standin_repo(tmp_path)
    ready = root / ".venv-vllm" / "bin" / "python"  # stand-in: `python -c "import vllm"` works
    ready.parent.mkdir(parents=True)
    ready.write_text("#!/usr/bin/env bash\nexit 0\n")
    ready.chmod(0o755)
    summary, journal, out = _run_test_sh(tmp_path)
    builds = [ln for ln in journal if ln.startswith("start setup_vllm_env")]
    assert builds == ["start setup_vllm_env  .venv-vllm020"], journal  # 0.20 only
    assert summary[1] == "vLLM 0.32.0 tier (.venv-vllm): 3 passed in 1s (exit 0)", out


def test_the_next_tiers_libraries_are_read_while_the_tier_before_it_runs(tmp_path: Path) -> None:
    # warm_start (scripts/tier.sh): each lane-1 tier's files are read while the one before it
    # runs: the libraries, Python sources and bytecode of its venv (CUDA's included; data files
    # not), the NeMo-RL trees' with the tier they start beside; the loop ends with the run.
    root = _standin_repo(tmp_path)
    files = {
        venv: [root / venv / "lib" / f for f in ("a.so", "b.so.1", "nvidia/c.so", "d.txt")]
        for venv in (".venv-vllm", ".venv-vllm020", ".venv-vllm025")
    }
    pyc = (
        root / ".cache/pycache" / str(root / ".venv-vllm020").lstrip("/") / "lib/d.cpython-311.pyc"
    )
    tree = tmp_path / "upstream/main-abc/nemo_rl/x.so"
    for f in [*(f for fs in files.values() for f in fs), pyc, tree]:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("")
    bin_dir = tmp_path / "bin"  # a stand-in `cat` that journals what it was asked to read
    bin_dir.mkdir()
    (bin_dir / "cat").write_text(
        '#!/usr/bin/env bash\nfor f; do echo "read $f" >> "$JOURNAL"; done\n'
    )
    (bin_dir / "cat").chmod(0o755)
    summary, journal, out = _run_test_sh(
        tmp_path, PATH=f"{bin_dir}:{os.environ['PATH']}", JETRL_WARM_PERIOD_S="1",
        STANDIN_SLEEP_PY="2", STANDIN_SLEEP_TEST_VLLM="2", STANDIN_SLEEP_TEST_NEMO_RL="2",
        PYTHONPYCACHEPREFIX=str(root / ".cache/pycache"),
    )  # fmt: skip
    assert summary[-1] == "mutation check: 5 passed (exit 0)", out
    # each file's first read (the venvs' paths are relative to the repository)
    read = {
        str(root / ln.split(" ", 1)[1]): i
        for i, ln in reversed(list(enumerate(journal)))
        if ln.startswith("read ")
    }
    for venv, (so, so1, nv, data) in files.items():
        assert str(so) in read and str(so1) in read and str(nv) in read, (venv, journal)
        assert str(data) not in read, (venv, journal)
    assert str(pyc) in read and str(tree) in read, journal
    # 0.32's before the default suite ends; 0.20's once the default suite is over, while the
    # 0.32 tier runs; main's (the second lane's) before both trees start
    assert read[str(files[".venv-vllm"][0])] < _at(journal, "end default-python")
    at_020 = read[str(files[".venv-vllm020"][0])]
    assert _at(journal, "end default-python") < at_020 < _at(journal, "end test_vllm")
    assert read[str(tree)] < _at(journal, "start test_nemo_rl")
    time.sleep(2)  # a loop left running would read again within JETRL_WARM_PERIOD_S
    after = (tmp_path / "journal").read_text().splitlines()
    assert after == journal, "warm_start's loop outlived the run"
