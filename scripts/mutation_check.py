"""Mutation check: does the suite's behaviour catch each deliberate, realistic bug?

Each mutant in ``scripts/mutants.py`` replaces one snippet of one source file (its original text
must occur exactly once). The harness copies the repository's files (``git ls-files -co
--exclude-standard``: no environments, no caches) to a temporary directory, applies one mutant at
a time *there* (the working tree is never touched), and runs only the tests listed for that
mutant, in that copy, with ``PYTHONPATH`` pointing at it. A pytest plugin written into the copy
records which file the mutated module was imported from, so a mutant only counts as KILLED when
its tests failed *and* ran the mutated code from the copy. Verdicts:

    KILLED      a listed test failed (or the run hung past the limit) on the mutated code
    SURVIVED    every listed test passed: a real bug the suite would let through (exit 1)
    EQUIVALENT  the mutant leaves the module's AST unchanged (a no-op; tests are not run), or it
                survived and the list documents why it is equivalent
    ERROR       it cannot be applied, its tests did not reach the copy's module, or the test
                that killed it fails on the unmutated code too (exit 2; scripts/mutation_confirm.py)
    NOT RUN     its environment (.venv-vllm, .venv-vllm020 + NeMo-RL source) is missing: a
                warning, an error when CI=true

Two planted controls run first: a no-op mutant (reported EQUIVALENT from the AST) and a mutant
that changes the AST but not behaviour (must be SURVIVED). Either one reported KILLED means the
harness cannot tell a surviving mutant from a killed one (exit 2). Usage, from the repo root:

    python scripts/mutation_check.py [--only SUBSTR ...] [--json OUT] [--keep]

``--only`` runs the mutants whose name contains one of the substrings, ``--first N`` the first N
listed (the controls always run). The last line reads ``N killed, ...`` (scripts/tier.sh shows it
in test.sh's summary). ``--jobs N`` (default ``JETRL_MUTANT_JOBS`` or 2) judges N mutants at a
time, each lane on its own copy with its own fork servers: a mutant's run is mostly one Python
thread (imports, small tensors), so two lanes use CI's two cores (docs/ci_times.md).

Each run is one pytest session in a fresh process forked by a server per environment that
imported torch, numpy, triton, pytest... once (scripts/mutation_fork.py; never a module of this
repository, so the mutated module is imported afresh in every child). ``JETRL_MUTANTS_FORK=0``
starts a fresh ``python -m pytest`` per mutant instead (the old path, for debugging).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutation_confirm import confirm_kills, failed_ids, passed_in_tiers
from mutation_fork import ForkServer  # the standard library only
from mutation_report import report

REPO = Path(__file__).resolve().parents[1]
FORK_VAR = "JETRL_MUTANTS_FORK"  # 0: a fresh interpreter per mutant run (the old path)
JOBS_VAR = "JETRL_MUTANT_JOBS"  # mutants judged at a time (lanes), default 2
# test.sh's tiers write <kind>.txt here (the tests that passed, tests/conftest.py), for the
# environment kinds of `command`: default (.venv), vllm (.venv-vllm), nemo_rl (v0.7.0's)
PASSED_DIR_VAR = "JETRL_PASSED_DIR"
PASSED_LOG_VAR = "JETRL_PASSED_LOG"
TEST_TIMEOUT_S = 120  # per test (pytest-timeout): a hung test fails with its stack
RUN_TIMEOUT_S = 300  # per mutant run: past it the mutant counts as killed (it hangs)
PROBE = "_jetrl_mutation_probe"
PROBE_SRC = '''"""pytest plugin (written by scripts/mutation_check.py): where the mutated module came from."""
import json, os, sys


def pytest_sessionfinish(session, exitstatus):
    if "JETRL_MUTANT_PROBE" not in os.environ:  # the unmutated baseline run
        return
    mod = sys.modules.get(os.environ["JETRL_MUTANT_MODULE"])
    with open(os.environ["JETRL_MUTANT_PROBE"], "w") as f:
        json.dump({"file": getattr(mod, "__file__", None)}, f)
'''


@dataclass(frozen=True)
class Mutant:
    """One deliberate bug: ``old`` -> ``new`` in ``file``, judged by ``tests``."""

    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    env: str = "default"  # "default" (.venv), "vllm" (.venv-vllm), "nemo_rl" (v0.7.0 tier)
    equivalent: str | None = None  # why a survivor is not a bug (documented equivalent)
    planted: bool = False  # a control that must not be KILLED


@dataclass
class Outcome:
    mutant: Mutant
    verdict: str
    seconds: float = 0.0
    detail: str = ""
    failed: list[str] = field(default_factory=list)


def load_mutants(path: Path = REPO / "scripts" / "mutants.py") -> list[Mutant]:
    spec = importlib.util.spec_from_file_location("jetrl_mutants", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [*mod.CONTROLS, *mod.MUTANTS]


# Folders whose files are imported by their own name, that folder on sys.path (the scripts; the
# benchmarks through tests/gpu_bench_fixtures.py's `bench` fixture).
FLAT_IMPORT_DIRS = ("scripts/", "benchmarks/gpu/")


def module_name(rel: str) -> str:
    """The name ``rel`` (a repository path) is imported by in the tests."""
    name = rel.removesuffix(".py").removesuffix("/__init__")
    for folder in FLAT_IMPORT_DIRS:
        name = name.removeprefix(folder)
    return name.replace("/", ".")


def mutate_text(text: str, m: Mutant) -> str:
    """The mutated source; ValueError unless ``m.old`` occurs exactly once."""
    n = text.count(m.old)
    if n != 1 or m.old == m.new:
        raise ValueError(f"{m.name}: its original text occurs {n} times in {m.file}")
    return text.replace(m.old, m.new)


def is_noop(text: str, mutated: str, python: bool = True) -> bool:
    """True when the mutation leaves the module's AST (a shell script: its text) unchanged."""
    return ast.dump(ast.parse(text)) == ast.dump(ast.parse(mutated)) if python else text == mutated


def copy_repo(root: Path, dst: Path) -> None:
    """Copy the files git would ship (tracked + untracked, not ignored) from root to dst."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, out.split("\0")):
        src = root / rel
        if src.is_file() and not src.is_symlink():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    (dst / f"{PROBE}.py").write_text(PROBE_SRC)


def command(root: Path, copy: Path, env_kind: str, tests: list[str]) -> tuple[list[str], dict]:
    """The pytest command and environment of one run in ``copy``."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(copy)}
    env.pop("JETRL_GOLDEN_DIR", None)
    env.pop(PASSED_LOG_VAR, None)  # a run on a mutant never lists its tests as passed unmutated
    # TE's pure-Python files (tests/megatron/test_te_layout_from_te.py) are not in the copy.
    env.setdefault("JETRL_TE_RECIPE_DIR", str(root / ".venv-te-recipe"))
    venv = {"default": ".venv", "vllm": ".venv-vllm", "nemo_rl": ".venv-vllm020"}[env_kind]
    if env_kind == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = env.get("VLLM_CPU_KVCACHE_SPACE", "1")
    # NeMo-RL's source beside the real checkout, not the copy (the default suite reads it too)
    upstream = Path(
        os.environ.get("JETRL_NEMO_RL_UPSTREAM", root.parent / "shared/upstream/nemo-rl")
    ).resolve()
    env["JETRL_NEMO_RL_UPSTREAM"] = str(upstream)
    if env_kind == "nemo_rl":  # as scripts/nemo_rl_env.sh builds it, from the real checkout
        tree = upstream / "v0.7.0"
        overlay = root / ".venv-nemo-rl" / "site"
        env["PYTHONPATH"] = f"{copy}:{overlay}:{tree}"
        env.update(
            JETRL_NEMO_RL_UPSTREAM=str(upstream),
            JETRL_NEMO_RL_TREE="v0.7.0",
            JETRL_NEMO_RL_TREE_DIR=str(tree),
            RAY_USAGE_STATS_ENABLED="0",
        )
    py = root / venv / "bin" / "python"
    cmd = [str(py), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", PROBE]
    cmd += [f"--timeout={TEST_TIMEOUT_S}", "--runslow", "-rf", *tests]
    return cmd, env


def missing_env(root: Path, kind: str) -> str | None:
    """Why ``kind``'s environment cannot run here (None: it can)."""
    cmd, env = command(root, root, kind, [])
    need = [Path(cmd[0])] + [Path(p) for p in env["PYTHONPATH"].split(":")[1:]]
    gone = [str(p) for p in need if not p.exists()]
    return f"missing {', '.join(gone)}" if gone else None


class Servers:
    """One fork server per environment kind, started at its first mutant (None: the old path)."""

    def __init__(self, root: Path, copy: Path) -> None:
        self.root, self.copy, self.live = root, copy, {}

    def get(self, kind: str) -> ForkServer:
        if kind in self.live and self.live[kind].proc.poll() is not None:  # it died: a new one
            self.live.pop(kind).close()
        if kind not in self.live:
            cmd, env = command(self.root, self.copy, kind, [])
            self.live[kind] = ForkServer(cmd[0], self.copy, env, [self.copy, self.root])
        return self.live[kind]

    def close(self) -> None:
        for s in self.live.values():
            s.close()
        self.live.clear()


def run_tests(
    root: Path, copy: Path, m: Mutant, probe: Path, servers: Servers | None = None
) -> tuple[int, str, str | None]:
    """(pytest exit status or 124 on timeout, its output, the mutated module's file or None)."""
    cmd, env = command(root, copy, m.env, list(m.tests))
    env.update(JETRL_MUTANT_MODULE=module_name(m.file), JETRL_MUTANT_PROBE=str(probe))
    probe.unlink(missing_ok=True)
    if servers is not None:  # cmd = [python, -m, pytest, *args]: the same args in a forked child
        out_file = copy / "_jetrl_mutant_output.txt"
        rc = servers.get(m.env).run(copy, cmd[3:], env, out_file, RUN_TIMEOUT_S)
        out = out_file.read_text(errors="replace")
    else:
        try:
            p = subprocess.run(
                cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
            )
            rc, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out = 124, str(exc.stdout or "")
    where = json.loads(probe.read_text())["file"] if probe.exists() else None
    return rc, out, where


def judge(root: Path, copy: Path, m: Mutant, probe: Path, servers: Servers | None) -> Outcome:
    path = copy / m.file
    try:
        text = path.read_text()
        mutated = mutate_text(text, m)
    except (OSError, ValueError) as exc:
        return Outcome(m, "ERROR", detail=str(exc))
    if is_noop(text, mutated, m.file.endswith(".py")):
        return Outcome(m, "EQUIVALENT", detail="no AST change; tests not run")
    t0 = time.monotonic()
    try:
        if servers is not None:  # its imports happen before the mutant is written
            servers.get(m.env)
        path.write_text(mutated)
        try:
            rc, out, where = run_tests(root, copy, m, probe, servers)
        finally:
            path.write_text(text)
    except (RuntimeError, OSError) as exc:  # the fork server refused to serve or died (exit 2)
        return Outcome(m, "ERROR", time.monotonic() - t0, str(exc))
    dt = time.monotonic() - t0
    failed = failed_ids(out)
    # A shell script imports nowhere: its tests run it by their own path, inside the copy.
    if m.file.endswith(".py") and (where is None or Path(where).resolve() != path.resolve()):
        why = f"the tests imported {module_name(m.file)} from {where}, not from the copy"
        return Outcome(m, "ERROR", dt, why + "\n" + out[-1500:], failed)
    if rc == 0:
        verdict = "EQUIVALENT" if m.equivalent else "SURVIVED"
        return Outcome(m, verdict, dt, m.equivalent or "every listed test passed")
    if rc == 124 or rc == 1 or (rc == 2 and "error" in out.lower()):
        return Outcome(m, "KILLED", dt, "timed out" if rc == 124 else "", failed)
    return Outcome(m, "ERROR", dt, f"pytest exited {rc}\n" + out[-1500:], failed)


def judge_all(root: Path, copies: list[Path], mutants: list[Mutant], fork: bool) -> list[Outcome]:
    """Every mutant's outcome, in list order: one lane (thread) per copy, each taking the next
    mutant and mutating only its own copy, through its own fork servers; lines print as each
    verdict comes."""
    outcomes: list[Outcome | None] = [None] * len(mutants)
    absent = {k: why for k in {m.env for m in mutants} if (why := missing_env(root, k))}
    todo = list(enumerate(mutants))
    lock = threading.Lock()

    def show(o: Outcome) -> None:
        m = o.mutant
        with lock:
            if o.verdict == "NOT RUN":
                print(f"NOT RUN    {m.name}  [{m.file}; {o.detail}]", flush=True)
                return
            tag = " (planted control)" if m.planted else ""
            print(f"{o.verdict:10s} {m.name}{tag}  [{m.file}; {o.seconds:.0f} s]", flush=True)
            if o.verdict in ("SURVIVED", "ERROR") or (m.planted and o.verdict == "KILLED"):
                print("    " + o.detail.replace("\n", "\n    "), flush=True)

    def lane(copy: Path) -> None:
        servers = Servers(root, copy) if fork else None
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    i, m = todo.pop(0)
                if m.env in absent:  # in CI a failure (report()), elsewhere a warning
                    o = Outcome(m, "NOT RUN", detail=f"{m.env}: {absent[m.env]}")
                else:
                    o = judge(root, copy, m, copy / "probe.json", servers)
                outcomes[i] = o
                show(o)
        finally:
            if servers is not None:
                servers.close()

    threads = [threading.Thread(target=lane, args=(c,), daemon=True) for c in copies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lost = [m.name for m, o in zip(mutants, outcomes, strict=True) if o is None]
    if lost:  # a lane died on something judge() does not catch: never a silent gap
        raise RuntimeError(f"mutation check: no verdict for {lost}")
    return [o for o in outcomes if o is not None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=REPO, help="repository root")
    ap.add_argument("--only", nargs="*", help="run mutants whose name contains one of these")
    ap.add_argument("--first", type=int, help="run only the first N mutants listed")
    ap.add_argument("--json", type=Path, help="write the outcomes here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help=f"mutants judged at a time, each on its own copy (default ${JOBS_VAR} or 2)",
    )
    ap.add_argument(
        "--no-baseline", action="store_true", help="skip the unmutated run of the killing tests"
    )
    ap.add_argument(
        "--passed",
        type=Path,
        default=os.environ.get(PASSED_DIR_VAR) or None,
        help="a folder of <kind>.txt, the tests this run's tiers saw pass unmutated: those are "
        f"not run again to confirm a kill (default ${PASSED_DIR_VAR}; test.sh sets it)",
    )
    args = ap.parse_args(argv)
    raw = str(args.jobs) if args.jobs is not None else os.environ.get(JOBS_VAR, "2")
    if not raw.isdigit() or int(raw) < 1:  # exit 2 before any copy is made
        where = "--jobs" if args.jobs is not None else f"${JOBS_VAR}"
        ap.error(f"{where}={raw!r}: use a whole number of mutants at a time, 1 or more")
    args.jobs = int(raw)
    t_start = time.monotonic()
    mutants = load_mutants(args.root / "scripts" / "mutants.py")
    if args.only:
        mutants = [m for m in mutants if m.planted or any(s in m.name for s in args.only)]
    if args.first is not None:
        controls = [m for m in mutants if m.planted]
        mutants = controls + [m for m in mutants if not m.planted][: args.first]
    jobs = min(args.jobs, max(1, len(mutants)))
    copies = [Path(tempfile.mkdtemp(prefix="jetrl-mutants-")) for _ in range(jobs)]
    fork = os.environ.get(FORK_VAR, "1") != "0"
    try:
        for copy in copies:
            copy_repo(args.root, copy)
        how = "forked from one server per environment" if fork else f"{FORK_VAR}=0: fresh pythons"
        where = ", ".join(map(str, copies))
        print(
            f"mutation check: {len(mutants)} mutants, {jobs} at a time, on copies in {where} ({how})",
            flush=True,
        )
        outcomes = judge_all(args.root, copies, mutants, fork)
        if not args.no_baseline:
            passed = passed_in_tiers(args.passed) if args.passed else {}
            confirm_kills(args.root, copies[0], outcomes, command, args.jobs, passed)
    finally:
        if args.keep:
            print(f"kept the copies in {', '.join(map(str, copies))}")
        else:
            for copy in copies:
                shutil.rmtree(copy, ignore_errors=True)
    return report(outcomes, time.monotonic() - t_start, args.json)


if __name__ == "__main__":
    sys.exit(main())
