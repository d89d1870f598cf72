"""One process owns a run directory: `RunDirLock`.

``<dir>/.jetrl-run.lock`` holds an exclusive ``flock`` for the life of the run and names the
holder (pid, host, start time, run id, command) as JSON. The kernel drops the ``flock`` when
the holder exits in any way (``kill -9`` included), so a lock file that can be locked again is
stale by construction: the new run takes it over and says whose it was. A run that finds the
lock held exits with `RunDirBusy` (a `UserError`: exit 2) naming the holder. A normal exit or
an exception releases the lock and removes the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nemo_jetrl.errors import UserError

LOCK_FILE = ".jetrl-run.lock"


class RunDirBusy(UserError):
    """Another live process owns the run directory."""


def describe_holder(info: dict[str, Any] | None) -> str:
    """``pid 123 on host h, started 2026-..Z (run abc)``, or a note when the file is empty."""
    if not info:
        return "a process that has not written its details yet"
    text = f"pid {info.get('pid', '?')} on host {info.get('host', '?')}"
    text += f", started {info.get('started', '?')}"
    if info.get("run_id"):
        text += f" (run {info['run_id']})"
    if info.get("command"):
        text += f": {info['command']}"
    return text


def read_holder(path: str | Path) -> dict[str, Any] | None:
    """The holder recorded in a lock file (None if absent, empty or unreadable)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8") or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def make_dir(key: str, path: Path) -> None:
    """``mkdir -p`` with a message naming the config key when it cannot be done."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocker = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a regular file" if blocker else (exc.strerror or str(exc))
        raise UserError(
            f"{key}: cannot create the directory {path} ({why}); choose another {key}"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{key}: the directory {path} is not writable; choose another {key}")


class RunDirLock:
    """Exclusive ownership of one or more run directories (see the module docstring)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._held: list[tuple[Path, int]] = []
        self._made: list[Path] = []  # directories `acquire` created

    def acquire(
        self, dirs: Sequence[tuple[str, Path]], *, log: Callable[[str], None] = print
    ) -> RunDirLock:
        """Create and lock each ``(config key, dir)``; all or none (`RunDirBusy`, `UserError`)."""
        seen: set[Path] = set()
        try:
            for key, d in dirs:
                missing = [p for p in (Path(d), *Path(d).parents) if not p.exists()]
                make_dir(key, Path(d))
                self._made.extend(missing)
                real = Path(d).resolve()
                if real not in seen:
                    seen.add(real)
                    self._lock_one(key, real, log)
        except BaseException:
            self.abandon()
            raise
        return self

    def _lock_one(self, key: str, d: Path, log: Callable[[str], None]) -> None:
        path = d / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirBusy(
                    f"{key} {d} is in use by another run: {describe_holder(read_holder(path))}. "
                    f"Wait for it to finish or stop it, or choose another {key}."
                ) from None
            try:  # the previous holder may have unlinked the file between our open and lock
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = read_holder(path)
        if stale is not None:
            log(
                f"{key} {d}: took over a stale lock of {describe_holder(stale)}; that process "
                "is gone (it did not exit cleanly)"
            )
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "run_id": self.run_id,
            "command": " ".join(sys.argv)[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)
        self._held.append((path, fd))

    def release(self) -> None:
        """Remove the lock files and drop the locks (idempotent)."""
        while self._held:
            path, fd = self._held.pop()
            with contextlib.suppress(OSError):  # first: a waiter re-checks the inode
                os.unlink(path)
            os.close(fd)

    def abandon(self) -> None:
        """`release`, then remove the directories `acquire` created that are still empty: a
        run refused before any work leaves nothing behind (idempotent)."""
        self.release()
        made, self._made = sorted(self._made, key=lambda p: len(p.parts), reverse=True), []
        for d in made:
            with contextlib.suppress(OSError):  # not empty: something else wrote there
                d.rmdir()

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
