"""Fork server for scripts/mutation_check.py: pay the third-party imports once per environment.

Each mutant's pytest run used to start a fresh interpreter (2-9 s of torch, numpy, triton, pytest
imports before a test ran). The server runs in the mutant's environment (its python, cwd = the
temporary copy, the run's environment variables), imports the heavy *third-party* modules once
(``PREIMPORT``), then forks one child per mutant run. The child sets up what ``python -m pytest``
would (cwd first on ``sys.path``, argv, the request's environment), runs ``pytest.main`` on the
mutant's listed tests with its output in a file, and exits with pytest's status.

Never imported by the parent: anything from the copy or the repository (``nemo_jetrl``, tests,
conftest), so every child imports the module under test afresh, mutated. The server checks that
after its imports (a module loaded from the copy, or a thread running, refuses to serve: exit 2),
and a child refuses a request whose environment differs from the server's in more than the
mutant's own keys (the imports saw the server's). ``JETRL_MUTANTS_FORK=0`` in mutation_check.py
runs each mutant in a fresh ``python -m pytest`` instead (the old path, for debugging).

Protocol: one JSON line per request on stdin ({"args", "env", "out", "timeout"}), one JSON line per
reply on the server's original stdout ({"rc"}; 124 when the run passed its timeout, a negative
number when a signal ended it). Only the standard library at module level: mutation_check.py
imports the client half, and a child spawned by multiprocessing re-imports this file.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

# Heavy third-party modules the suite imports (measured: torch alone ~1.4 s of CPU per start).
# A module missing from an environment is left out. Never a module of this repository, nor
# triton: it fixes interpreter-or-compiler per @jit function from TRITON_INTERPRET, which
# tests/conftest.py sets during the session (a preimported triton failed the Triton kernel
# tests: "Cannot call @triton.jit'd outside of the scope of a kernel"); so neither
# torch._dynamo nor transformers.modeling_utils, which import it.
PREIMPORT = (
    "numpy",
    "torch",
    "safetensors.torch",
    "yaml",
    "omegaconf",
    "pydantic",
    "transformers",
    "pytest",
)
PREIMPORT_VAR = "JETRL_MUTANTS_PREIMPORT"  # more modules, comma separated (tuning, tests)
OWN_KEYS = ("JETRL_MUTANT_MODULE", "JETRL_MUTANT_PROBE")  # the only per-request variables
OWN_PACKAGES = ("nemo_jetrl", "tests", "conftest", "triton")  # imported by each child only


def loaded_from(roots: list[str]) -> list[str]:
    """Modules in ``sys.modules`` a child must import itself: a package in ``OWN_PACKAGES``, or a
    file under one of ``roots`` outside its hidden folders (.venv*, .cache: third-party)."""
    bad = []
    for name, mod in list(sys.modules.items()):
        if name in ("__main__", "__mp_main__"):  # this server
            continue
        f = getattr(mod, "__file__", None)
        f = Path(f).resolve() if isinstance(f, str) and os.path.isabs(f) else Path("/")
        under = [f.relative_to(r) for r in map(Path, roots) if f.is_relative_to(r)]
        if name.split(".")[0] in OWN_PACKAGES or any(not u.parts[0].startswith(".") for u in under):
            bad.append(name)
    return sorted(bad)


def _python_threads() -> int:
    """Python threads running (a lock one holds would stay held in a child). Native pools need
    no check: OpenBLAS's (numpy) stops at fork by its own pthread_atfork handler, and no
    OpenMP pool exists before a parallel region runs (the server computes nothing)."""
    import threading

    return threading.active_count()


def _child(req: dict[str, Any], base_env: dict[str, str], reply_fd: int) -> int:
    os.setpgid(0, 0)  # its own group: a timeout kills the engines it started too
    os.close(reply_fd)
    fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    env = req["env"]
    differ = sorted(k for k in env.keys() | base_env.keys() if env.get(k) != base_env.get(k))
    if set(differ) - set(OWN_KEYS):
        print(f"fork server: the run's environment differs in {differ}", file=sys.stderr)
        return 3
    os.environ.update(env)
    os.chdir(req["cwd"])
    sys.path.insert(0, req["cwd"])  # as `python -m pytest` in cwd
    importlib.invalidate_caches()
    import pytest

    sys.argv = [str(Path(pytest.__file__).with_name("__main__.py")), *req["args"]]
    rc = int(pytest.main(req["args"]))
    import atexit

    atexit._run_exitfuncs()  # what interpreter exit would run (engine shutdown hooks)
    sys.stdout.flush()
    sys.stderr.flush()
    return rc


def _run(req: dict[str, Any], base_env: dict[str, str], reply_fd: int) -> int:
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            code = _child(req, base_env, reply_fd)
        except BaseException:  # the child must never return into the server's loop
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + req["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            rc = 124
            break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # what the run left behind (an engine process) goes too
    return rc


def serve(roots: list[str]) -> int:
    sys.path.pop(0)  # scripts/: nothing of the repository is importable but through PYTHONPATH
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # an import that prints cannot corrupt the replies
    start_env = {k: v for k, v in os.environ.items() if k not in OWN_KEYS}  # what imports saw
    extra = [m for m in os.environ.get(PREIMPORT_VAR, "").split(",") if m]
    loaded = []
    for name in (*PREIMPORT, *extra):
        with contextlib.suppress(Exception):  # absent or broken here: the child imports it
            importlib.import_module(name)
            loaded.append(name)
    gc.collect()
    gc.freeze()  # the children share these pages instead of copying them on the first gc
    hello = {"loaded": loaded, "own": loaded_from(roots), "threads": _python_threads()}
    print(json.dumps(hello), file=reply, flush=True)
    if hello["own"] or hello["threads"] != 1:
        return 2
    for line in filter(str.strip, sys.stdin):
        req = json.loads(line)
        print(json.dumps({"rc": _run(req, start_env, reply.fileno())}), file=reply, flush=True)
    return 0


class ForkServer:
    """The harness's side: one server per environment kind."""

    def __init__(self, python: str, cwd: Path, env: dict[str, str], roots: list[Path]) -> None:
        self.log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        env = {k: v for k, v in env.items() if k not in OWN_KEYS}
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), *map(str, roots)],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.hello = json.loads(self._line())
        if self.hello["own"] or self.hello["threads"] != 1:
            self.close()
            raise RuntimeError(
                f"fork server refused to serve: modules of the copy/repository imported by the "
                f"parent {self.hello['own']}, Python threads {self.hello['threads']} (must be 1); "
                f"take them out of {PREIMPORT_VAR} / PREIMPORT in scripts/mutation_fork.py"
            )

    def _line(self) -> str:
        assert self.proc.stdout
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            tail = self.log.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"fork server exited ({self.proc.poll()}):\n{tail}")
        return line

    def run(
        self, cwd: Path, args: list[str], env: dict[str, str], out: Path, timeout: float
    ) -> int:
        """pytest's exit status for ``args`` run in a fresh child (124: past ``timeout``)."""
        assert self.proc.stdin
        req = {"cwd": str(cwd), "args": args, "env": env, "out": str(out), "timeout": timeout}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return int(json.loads(self._line())["rc"])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
