"""scripts/test.sh's environments, on a stand-in repository (tests/script_standin.py): each
built once while the default suite runs, each tier waiting for its own; a failed build is its
tier not run (a full disk named as such); skipped tiers build nothing; a working one is not
rebuilt; the next tier's libraries are read while the tier before it runs; a disk too small for
the run is warned of up front. Lanes and interrupts:
tests/test_test_sh_lanes.py."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from script_standin import _at, _run_test_sh, _standin_repo


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


def test_a_full_disk_is_named_in_the_summary_and_free_space_follows_each_tier(
    tmp_path: Path,
) -> None:
    full = "OSError: [Errno 28] No space left on device: '/x/site-packages/torch/lib/a.so'"
    summary, _, out = _run_test_sh(tmp_path, fail="0.20.0", STANDIN_FAIL_MESSAGE=full)
    log = tmp_path / "jetrl-vllm-setup-0.20.0.log"
    line = summary[2]
    why = re.fullmatch(
        r"vLLM 0\.20\.0 tier \(\.venv-vllm020\): not run, environment setup failed: no space left "
        rf"on device \((\d+\.\d) GiB free now; log: {re.escape(str(log))}\) \(exit 1\)",
        line,
    )
    assert why, (line, out)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize / 2**30
    assert abs(float(why[1]) - free) < 1.0, (why[1], free)  # this disk's free space, not a constant
    assert full in out  # and the log's tail above the summary, as for any failed build
    # every tier that ran is followed by the free space it left
    for name in ("default suite (.venv)", "vLLM 0.32.0 tier (.venv-vllm)", "mutation check"):
        assert re.search(rf"^\[disk\] after {re.escape(name)}: \d+\.\d GiB free$", out, re.M), out


@pytest.mark.parametrize("need", [0, 10**6])
def test_the_run_warns_up_front_when_the_disk_cannot_hold_it(tmp_path: Path, need: int) -> None:
    root = _standin_repo(tmp_path)
    tier_sh = root / "scripts" / "tier.sh"
    text, n = re.subn(r"^FULL_RUN_DISK_GIB=\d+$", f"FULL_RUN_DISK_GIB={need}", tier_sh.read_text(),
                      flags=re.M)  # fmt: skip
    assert n == 1  # one home for the figure
    tier_sh.write_text(text)
    summary, _, out = _run_test_sh(tmp_path)
    assert re.search(rf"^disk: \d+\.\d GiB free here; .* up to ~{need} GiB$", out, re.M), out
    warned = "test.sh: warning: only" in out and "No space left on device" in out
    assert warned == (need > 0), out  # a warning, not a stop: every tier still runs
    assert summary[-1] == "mutation check: 5 passed (exit 0)", out


def test_skipped_tiers_build_no_environment_and_still_fail_ci(tmp_path: Path) -> None:
    summary, journal, _ = _run_test_sh(tmp_path, JETRL_SKIP_VLLM="1", JETRL_SKIP_NEMO_RL="1")
    assert not [ln for ln in journal if "setup_vllm_env" in ln or "setup_nemo_rl_env" in ln]
    assert summary[-2:] == [
        "JETRL_SKIP_VLLM=1: not run, CI=true runs every tier; unset JETRL_SKIP_VLLM (exit 1)",
        "JETRL_SKIP_NEMO_RL=1: not run, CI=true runs every tier; unset JETRL_SKIP_NEMO_RL (exit 1)",
    ]


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
