"""scripts/test.sh's lanes and interrupts, on a stand-in repository (tests/script_standin.py):
the second lane runs beside the first and the summary keeps tier order, the NeMo-RL trees run
side by side by default, and an interrupted run ends its background builds and the second lane's
tier. Environment builds: tests/test_test_sh_environments.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from script_standin import _at, _run_test_sh, _standin_repo, _test_sh_env


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


def test_each_tier_lists_what_passed_where_the_mutation_check_reads_it(tmp_path: Path) -> None:
    """The default suite, the vLLM 0.32 tier (.venv-vllm) and NeMo-RL v0.7.0's tier write the
    tests they saw pass under the mutation check's environment kinds (default, vllm, nemo_rl:
    scripts/mutation_check.py's `command`); the other tiers, whose environments no mutant runs
    in, write none; the mutation check reads that folder (its last phase then skips those)."""
    _, _, out = _run_test_sh(tmp_path, JETRL_VLLM_VERSIONS="0.32.0 0.20.0")
    lines = (tmp_path / "journal.passed").read_text().splitlines()
    folder = lines[-1].rsplit(" ", 1)[1]
    assert folder.startswith("jetrl-passed-"), lines
    assert lines == [
        "default-python -m default.txt",
        "test_vllm .venv-vllm--runslow vllm.txt",
        "test_nemo_rl v0.7.0 nemo_rl.txt",
        f"default-python scripts/mutation_check.py reads {folder}",
    ], (lines, out)
    assert not (tmp_path / folder).exists()  # removed at the end
