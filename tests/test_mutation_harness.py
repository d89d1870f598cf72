"""scripts/mutation_check.py: its mutant list still applies, and it can tell KILLED from SURVIVED
from EQUIVALENT (end to end on a throwaway repository, the working tree left untouched)."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _harness():
    spec = importlib.util.spec_from_file_location(
        "mutation_check", REPO / "scripts/mutation_check.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutation_check", mod)
    spec.loader.exec_module(mod)
    return mod


def test_every_mutant_applies_to_the_current_code_and_names_behaviour_tests() -> None:
    mc = _harness()
    mutants = mc.load_mutants()
    names = [m.name for m in mutants]
    assert len(names) == len(set(names))
    assert sum(m.planted for m in mutants) == 2 and len(mutants) >= 30
    for m in mutants:
        text = (REPO / m.file).read_text()
        mutated = mc.mutate_text(text, m)  # ValueError names a mutant whose code is gone
        noop = mc.is_noop(text, mutated, m.file.endswith(".py"))
        assert noop == (m.name.startswith("planted no-op")), m.name
        assert m.env in ("default", "vllm", "nemo_rl") and m.tests, m.name
        for t in m.tests:
            assert (REPO / t.split("::")[0]).is_file(), (m.name, t)
            assert "mutation" not in t, f"{m.name}: judged by behaviour tests only"


def test_failed_tests_are_read_from_pytests_summary_not_from_a_captured_log() -> None:
    """Seen in CI (2026-11-30): a killed NeMo-RL mutant's output held a captured log record of
    the test's own process, ``ERROR    nemo_jetrl...vllm_refit:vllm_refit.py:205 ...``, read as
    a failed test id; rerun unmutated, pytest found no such file and 9 kills became errors."""
    mc = _harness()
    out = "\n".join([
        "ERROR    nemo_jetrl.backends.nemo_rl.vllm_refit:vllm_refit.py:205 transport failed",
        "FAILED tests/backends/test_x.py::test_y[a-b] - AssertionError: no",
        "ERROR tests/backends/test_z.py - ImportError: gone",
        "ERROR tests/backends/test_w.py::test_v",
        "FAILED   not a summary line",
    ])  # fmt: skip
    assert mc.failed_ids(out) == [
        "tests/backends/test_x.py::test_y[a-b]",
        "tests/backends/test_z.py",
        "tests/backends/test_w.py::test_v",
    ]


def test_the_planted_no_op_is_equivalent_not_killed() -> None:
    mc = _harness()
    noop = next(m for m in mc.load_mutants() if m.name.startswith("planted no-op"))
    text = (REPO / noop.file).read_text()
    assert mc.is_noop(text, mc.mutate_text(text, noop))
    with pytest.raises(ValueError, match="occurs 0 times"):
        mc.mutate_text("x = 1\n", noop)
    # a shell script compares as text; scripts/ and benchmarks/gpu/ are imported by their own name
    assert mc.is_noop("a=1\n", "a=1\n", python=False) and not mc.is_noop("a=1", "a=2", False)
    assert mc.module_name("scripts/census_cache.py") == "census_cache"
    assert mc.module_name("nemo_jetrl/fp8/__init__.py") == "nemo_jetrl.fp8"
    assert mc.module_name("benchmarks/gpu/bench_local_grpo.py") == "bench_local_grpo"
    assert mc.module_name("scripts/mutant_catalog/gpu.py") == "mutant_catalog.gpu"


MOD = "def clip(x, lo, hi):\n    return min(max(x, lo), hi)\n\n\ndef pad(n):\n    return n + 1\n"
TEST = (
    "from pkg.mod import clip, pad\n\n\n"
    "def test_clip():\n    assert clip(5, 0, 3) == 3 and clip(-1, 0, 3) == 0\n\n\n"
    "def test_pad():\n    assert pad(1) > 1\n"
)
MUTANTS = """from mutation_check import Mutant
CONTROLS = []
T = ("tests/test_mod.py",)
MUTANTS = [
    Mutant("clip max->min", "pkg/mod.py", "min(max(x, lo), hi)", "max(min(x, lo), hi)", T),
    Mutant("pad +1 -> +2", "pkg/mod.py", "return n + 1", "return n + 2", T),
    Mutant("no-op parens", "pkg/mod.py", "return n + 1", "return (n) + 1", T),
    Mutant("pad +1 -> +2, documented", "pkg/mod.py", "return n + 1", "return n + 2", T,
           equivalent="any pad > n is fine here"),
]
"""
CONFTEST = "def pytest_addoption(parser):\n    parser.addoption('--runslow', action='store_true')\n"


def _run_harness(
    root: Path, test: str, mutants: str, conftest: str = CONFTEST, **env_vars: str
) -> subprocess.CompletedProcess[str]:
    """A git repo at ``root`` holding pkg/mod.py (MOD), ``test`` as its tests and ``mutants`` as
    its scripts/mutants.py, with this repo's mutation_check.py run on it (no PYTHONPATH)."""
    for rel, text in {
        "pkg/__init__.py": "",
        "pkg/mod.py": MOD,
        "tests/test_mod.py": test,
        "tests/conftest.py": conftest,
        "scripts/mutants.py": mutants,
        ".gitignore": ".venv\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for script in (
        "mutation_check.py",
        "mutation_confirm.py",
        "mutation_fork.py",
        "mutation_report.py",
    ):
        shutil.copy(REPO / "scripts" / script, root / "scripts")
    (root / ".venv").symlink_to(Path(sys.executable).parents[1])
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env_vars
    return subprocess.run(
        [sys.executable, "scripts/mutation_check.py", "--root", str(root)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# the fork server (default) and fresh pythons; one lane, or two lanes mutating the same file,
# each on its own copy (were they to share one, "pad +1 -> +2" could run beside clip's mutant
# and be reported KILLED instead of SURVIVED)
@pytest.mark.parametrize(("fork", "jobs"), [("1", "2"), ("0", "2"), ("1", "1")])
def test_end_to_end_killed_survived_equivalent(tmp_path: Path, fork: str, jobs: str) -> None:
    root = tmp_path / "repo"
    p = _run_harness(root, TEST, MUTANTS, JETRL_MUTANTS_FORK=fork, JETRL_MUTANT_JOBS=jobs)
    out = p.stdout
    assert ("forked from one server" in out.splitlines()[0]) == (fork == "1"), out
    assert f"{jobs} at a time, on copies in " in out.splitlines()[0], out
    assert out.splitlines()[0].count("jetrl-mutants-") == int(jobs), out
    verdicts = {
        ln.split(None, 1)[1].split("  [")[0]: ln.split()[0]
        for ln in out.splitlines()
        if "  [" in ln
    }
    assert verdicts == {
        "clip max->min": "KILLED",
        "pad +1 -> +2": "SURVIVED",
        "no-op parens": "EQUIVALENT",
        "pad +1 -> +2, documented": "EQUIVALENT",
    }, out + p.stderr
    assert p.returncode == 1, out  # a survivor fails the check
    assert out.splitlines()[-1].startswith(
        "1 killed, 2 equivalent, 1 survived, 0 errors, 0 not run"
    ), out
    assert (root / "pkg/mod.py").read_text() == MOD  # the working tree was never edited


@pytest.mark.parametrize("jobs", ["lots", "0"])
def test_a_bad_lane_count_exits_2_naming_the_variable(tmp_path: Path, jobs: str) -> None:
    p = _run_harness(tmp_path / "repo", TEST, MUTANTS, JETRL_MUTANT_JOBS=jobs)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"$JETRL_MUTANT_JOBS={jobs!r}: use a whole number" in p.stderr, p.stderr
    assert "mutants," not in p.stdout  # nothing judged, no copy announced


def test_a_kill_by_a_test_that_fails_unmutated_is_an_error(tmp_path: Path) -> None:
    # test_broken fails on the unmutated code: the mutant it "kills" proves nothing, so the
    # harness reports ERROR (exit 2) after running the killing tests unmutated (confirm_kills).
    root = tmp_path / "repo"
    broken = TEST + "\n\ndef test_broken():\n    assert clip(5, 0, 3) == 5\n"
    mutants = MUTANTS.replace(
        'T = ("tests/test_mod.py",)', 'T = ("tests/test_mod.py::test_broken",)'
    )
    p = _run_harness(root, broken, mutants.split('    Mutant("pad')[0] + "]\n")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "ERROR      clip max->min" in p.stdout and "fails unmutated too" in p.stdout
    assert p.stdout.splitlines()[-1].startswith("0 killed, 0 equivalent, 0 survived, 1 errors")


@pytest.mark.parametrize("jobs", ["2", "1"])
def test_kills_by_tests_failing_unmutated_in_two_files_are_errors_with_xdist_too(
    tmp_path: Path, jobs: str
) -> None:
    # The default environment's confirm run uses one xdist worker per lane (loadfile): tests of
    # two files that fail unmutated, on two workers, each turn their mutant into ERROR, and a
    # real kill in a third file stays KILLED.
    root = tmp_path / "repo"
    for name, body in (("a", "assert clip(5, 0, 3) == 5"), ("b", "assert pad(1) == 5")):
        (root / "tests").mkdir(parents=True, exist_ok=True)
        (root / f"tests/test_{name}.py").write_text(
            f"from pkg.mod import clip, pad\n\n\ndef test_broken_{name}():\n    {body}\n"
        )
    mutants = """from mutation_check import Mutant
CONTROLS = []
MUTANTS = [
    Mutant("clip, broken a", "pkg/mod.py", "min(max(x, lo), hi)", "max(min(x, lo), hi)",
           ("tests/test_a.py::test_broken_a",)),
    Mutant("pad, broken b", "pkg/mod.py", "return n + 1", "return n + 3",
           ("tests/test_b.py::test_broken_b",)),
    Mutant("clip, real", "pkg/mod.py", "min(max(x, lo), hi)", "max(min(x, lo), hi)",
           ("tests/test_mod.py::test_clip",)),
]
"""
    p = _run_harness(root, TEST, mutants, JETRL_MUTANT_JOBS=jobs)
    out = p.stdout
    assert p.returncode == 2, out + p.stderr
    workers = "2 workers" if jobs == "2" else "1 worker"
    assert f"confirmed on unmutated code: default, 3 killing tests, {workers}, " in out, out
    assert "ERROR      clip, broken a" in out and "ERROR      pad, broken b" in out, out
    assert out.splitlines()[-1].startswith("1 killed, 0 equivalent, 0 survived, 2 errors"), out


def _passed_log_hook() -> str:
    """tests/conftest.py's plugin that lists the tests a tier saw pass ($JETRL_PASSED_LOG)."""
    src = (REPO / "tests/conftest.py").read_text()
    parts = [
        ast.get_source_segment(src, n) or ""
        for n in ast.parse(src).body
        if (isinstance(n, (ast.FunctionDef, ast.ClassDef)) and "assed" in n.name)
        or (isinstance(n, ast.Assign) and ast.unparse(n).startswith("PASSED_LOG_VAR"))
    ]
    assert len(parts) == 3, parts
    register = "def pytest_configure(config):\n    register_passed_log(config)\n"
    return "import os\nimport pytest\n" + CONFTEST + "\n\n".join([*parts, register])


def test_killing_tests_a_tier_saw_pass_are_not_rerun_and_mutant_runs_list_nothing(
    tmp_path: Path,
) -> None:
    """test.sh's tiers list what passed (tests/conftest.py, $JETRL_PASSED_LOG); the check's last
    phase does not rerun those (it took 243 s of CI's 693 s mutation tier, every killing test
    already run by a tier). A run on a mutant never writes the list, though the variable is set
    (were it written, a test that passed on mutated code would count as passing unmutated)."""
    root = tmp_path / "repo"
    passed, leak = tmp_path / "passed", tmp_path / "listed.txt"
    passed.mkdir()
    (passed / "default.txt").write_text("tests/test_mod.py::test_pad\n")
    # killed by test_pad, after test_clip passed on the mutated code
    mutants = MUTANTS.split("MUTANTS = [")[0] + (
        'MUTANTS = [Mutant("pad +1 -> -1", "pkg/mod.py", "return n + 1", "return n - 1", T)]\n'
    )
    conftest = _passed_log_hook()
    p = _run_harness(
        root, TEST, mutants, conftest, JETRL_PASSED_DIR=str(passed), JETRL_PASSED_LOG=str(leak)
    )
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    assert "KILLED     pad +1 -> -1" in out, out
    assert "default, 1 killing tests, every one passed in this run's tier" in out, out
    assert not leak.exists(), leak.read_text()
    # control: the same hook in a tier's run (no mutant) lists the tests that passed
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_mod.py"],
        cwd=root,
        env={**os.environ, "JETRL_PASSED_LOG": str(leak), "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert leak.read_text().split() == [
        "tests/test_mod.py::test_clip",
        "tests/test_mod.py::test_pad",
    ]
    # a killing test the tier did not see pass runs unmutated, as before
    (passed / "default.txt").write_text("tests/test_mod.py::test_clip\n")
    p = _run_harness(tmp_path / "repo2", TEST, mutants, conftest, JETRL_PASSED_DIR=str(passed))
    assert (
        "confirmed on unmutated code: default, 1 killing tests (0 more passed in this run's tier)"
        in p.stdout
    ), p.stdout


def test_a_module_the_fork_server_imported_from_the_copy_refuses_every_run(tmp_path: Path) -> None:
    # Were pkg.mod imported by the server before the mutant is written, every child would run the
    # unmutated module from the copy's path (the probe cannot tell): "clip max->min" would be
    # SURVIVED. The server refuses to serve instead (exit 2, the module named).
    root = tmp_path / "repo"
    p = _run_harness(root, TEST, MUTANTS, JETRL_MUTANTS_PREIMPORT="pkg.mod")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "ERROR      clip max->min" in p.stdout and "refused to serve" in p.stdout, p.stdout
    assert "'pkg.mod'" in p.stdout and "SURVIVED" not in p.stdout, p.stdout


def test_the_fork_server_in_this_repo_never_imported_nemo_jetrl() -> None:
    # The real server, as the check starts it for the default environment: its heavy imports
    # (torch, numpy, triton, pytest...) pulled in nothing of this repository.
    mc = _harness()
    cmd, env = mc.command(REPO, REPO, "default", [])
    server = mc.ForkServer(cmd[0], REPO, env, [REPO])
    server.close()
    assert {"torch", "numpy", "pytest"} <= set(server.hello["loaded"]), server.hello
    assert server.hello["own"] == [] and server.hello["threads"] == 1, server.hello
    # triton decides interpreter-or-compiler per kernel from TRITON_INTERPRET, which the tests'
    # conftest sets during the session: a server that imported it refuses to serve.
    with pytest.raises(RuntimeError, match=r"refused to serve.*'triton'"):
        mc.ForkServer(cmd[0], REPO, env | {"JETRL_MUTANTS_PREIMPORT": "triton"}, [REPO])
    # ...and the check it relies on names nemo_jetrl when it is imported:
    fork = importlib.import_module("mutation_fork")
    import nemo_jetrl.rl.metrics  # noqa: F401

    assert "nemo_jetrl.rl.metrics" in fork.loaded_from([str(REPO)])


def _serve(tmp_path: Path, tests: str):
    (tmp_path / "test_t.py").write_text(tests)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    fork = _harness().ForkServer(sys.executable, tmp_path, env, [tmp_path])
    return fork, env


def test_the_fork_server_returns_pytests_status_and_kills_a_run_past_its_limit(
    tmp_path: Path,
) -> None:
    t = "import time\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 0\n\n"
    t += "def test_hang():\n    time.sleep(600)\n"
    fork, env = _serve(tmp_path, t)
    out = tmp_path / "out.txt"
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:timeout"]
    try:
        assert fork.run(tmp_path, [*args, "test_t.py::test_ok"], env, out, 60) == 0
        assert "1 passed" in out.read_text()
        assert fork.run(tmp_path, [*args, "test_t.py::test_bad"], env, out, 60) == 1
        assert "1 failed" in out.read_text()
        t0 = time.monotonic()
        assert fork.run(tmp_path, [*args, "test_t.py::test_hang"], env, out, 3) == 124
        assert time.monotonic() - t0 < 30
        # a run whose environment differs from the server's (its imports saw another) is refused
        assert fork.run(tmp_path, args, env | {"OTHER": "1"}, out, 60) == 3
        assert "differs in ['OTHER']" in out.read_text()
    finally:
        fork.close()


def test_tests_find_the_shared_checkout_through_conftest_only() -> None:
    """The mutation check runs tests from a copy in a temporary directory, where ../shared is not
    beside them: a test building that path itself skipped there (two ERROR mutants in CI, while a
    stray /tmp/shared here hid it). conftest's paths honour the variables the check sets."""
    import re

    beside = re.compile(r"""parents?\b[^\n]*/\s*["']shared["']""")
    found = [
        f"{p.relative_to(REPO)}:{n}"
        for p in sorted((REPO / "tests").rglob("*.py"))
        if p.name != "conftest.py" or p.parent != REPO / "tests"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if beside.search(line)
    ]
    assert not found, f"use conftest's NEMO_RL_UPSTREAM / GOLDEN_DIR instead: {found}"
    assert beside.search((REPO / "tests" / "conftest.py").read_text())  # control: the rule sees it
