"""The mutation check's last phase: a kill counts only where its test passes unmutated.

`confirm_kills` runs, per environment, the tests that killed a mutant once on the unmutated copy
(scripts/mutation_check.py calls it after every mutant is judged); a mutant whose killing test
fails there too becomes ERROR. The standard library only, like the rest of the harness.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the harness's types; no import at run time (mutation_check imports this)
    from mutation_check import Outcome

# command(root, copy, env_kind, tests) -> (argv, env): mutation_check.command
Command = Callable[[Path, Path, str, list[str]], tuple[list[str], dict]]


# pytest's short summary: "FAILED tests/x.py::test_y[p] - why", "ERROR tests/x.py - why". Not a
# captured log record, "ERROR    pkg.module:file.py:205 message" (the tests' own processes log
# there now that vLLM's workers run in them).
_SUMMARY = re.compile(r"^(?:FAILED|ERROR) (\S+\.py(?:::\S+)?)(?: - .*)?$")


def failed_ids(out: str) -> list[str]:
    """The test ids pytest's short summary in ``out`` names as failed or in error."""
    return [m[1] for ln in out.splitlines() if (m := _SUMMARY.match(ln))]


def passed_in_tiers(folder: Path) -> dict[str, set[str]]:
    """``{kind: node ids}`` from ``folder``'s ``<kind>.txt`` (the tests test.sh's tiers saw pass,
    tests/conftest.py); a kind without its file: none."""
    return {
        f.stem: set(f.read_text(encoding="utf-8").split())
        for f in sorted(folder.glob("*.txt"))
        if f.is_file()
    }


def confirm_kills(
    root: Path,
    copy: Path,
    outcomes: list[Outcome],
    command: Command,
    workers: int = 1,
    passed: dict[str, set[str]] | None = None,
) -> None:
    """A kill counts only where the test that failed on the mutant passes on the unmutated code:
    per environment, the tests that killed a mutant (all its listed tests where none was named:
    a hang or a collection error) run once, unmutated; a mutant whose killing test fails there
    too becomes ERROR. (Cheaper than running every listed test unmutated first: a mutant's run
    stops at its first failure, -x, so most listed tests never run at all.) The default
    environment's run, most of this phase, uses ``workers`` pytest-xdist workers (one file per
    worker at a time) where its tests span files and its venv has xdist. A killing test named in
    ``passed[kind]`` (it passed unmutated in this run's tier of that environment) is not run
    again."""
    killed = [o for o in outcomes if o.verdict == "KILLED"]
    kinds = dict.fromkeys(o.mutant.env for o in killed)
    # one environment's run per thread: they are separate processes on their own tests
    threads = [
        threading.Thread(
            target=_confirm,
            args=(root, copy, killed, k, command, workers, (passed or {}).get(k, set())),
        )
        for k in kinds
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _xdist_workers(root: Path, kind: str, tests: list[str], workers: int) -> int:
    """Workers for ``kind``'s confirm run: 1 (one process) unless it is the default environment
    (the NeMo-RL and vLLM ones start engines and Ray, which two workers would contend for),
    its tests span two or more files and its venv has pytest-xdist."""
    files = {t.split("::")[0] for t in tests}
    if kind != "default" or workers < 2 or len(files) < 2:
        return 1
    has_xdist = any((root / ".venv").glob("lib/python*/site-packages/xdist/__init__.py"))
    return min(workers, len(files)) if has_xdist else 1


def _confirm(
    root: Path,
    copy: Path,
    killed: list[Outcome],
    kind: str,
    command: Command,
    workers: int,
    seen: set[str],
) -> None:
    """`confirm_kills` for the mutants of one environment kind (``seen``: passed in its tier)."""
    mine = [o for o in killed if o.mutant.env == kind]
    wanted = list(dict.fromkeys(t for o in mine for t in (o.failed or o.mutant.tests)))
    tests = [t for t in wanted if t not in seen]
    already = f" ({len(wanted) - len(tests)} more passed in this run's tier)" if seen else ""
    if not tests:
        print(f"confirmed on unmutated code: {kind}, {len(wanted)} killing tests, every one "
              "passed in this run's tier", flush=True)  # fmt: skip
        return
    cmd, env = command(root, copy, kind, tests)
    cmd.remove("-x")
    n = _xdist_workers(root, kind, tests, workers)
    if n > 1:
        cmd[cmd.index("-q") + 1 : cmd.index("-q") + 1] = ["-n", str(n), "--dist", "loadfile"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
    out = p.stdout + p.stderr
    # what the phase after the mutants costs, per environment (docs/ci_times.md)
    print(f"confirmed on unmutated code: {kind}, {len(tests)} killing tests{already}, "
          f"{n} worker{'s' if n > 1 else ''}, {time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip
    if p.returncode == 0:
        return
    bad = set(failed_ids(out))
    for o in mine:
        own = set(o.failed or o.mutant.tests) - seen  # what this run judged of its kill
        if own and (bad & own or not bad):  # not bad: the run failed as a whole (collection, usage)
            o.verdict = "ERROR"
            o.detail = (
                f"its killing test fails unmutated too (exit {p.returncode}):\n" + (out[-1500:])
            )
            print(f"ERROR      {o.mutant.name}  [{o.mutant.file}]", flush=True)
            print("    " + o.detail.replace("\n", "\n    "), flush=True)
