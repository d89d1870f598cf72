"""Output paths of the `jetrl` subcommands: probed before any work, so a path the process cannot
write is an exit-2 message naming the option, never a traceback afterwards; created only once
every other refusal is past (a refused command leaves nothing behind)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from nemo_jetrl.errors import UserError


def _named(path: Path, option: str, for_file: Path | None) -> str:
    return f"{option} {for_file}: its directory {path}" if for_file else f"{option} {path}"


def check_output_dir(path: Path, option: str, for_file: Path | None = None) -> None:
    """Refuse directory ``path`` unless it exists or could be created, and a file could be
    written in it; creates nothing (what it tries is removed). ``for_file``: the output file
    the user named, whose directory ``path`` is (for messages).

    ``os.access`` alone is not enough: it answers yes for root on /proc and /sys, where
    creating anything then fails."""
    named = _named(path, option, for_file)
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UserError(f"{named}: cannot be created, {probe} is a regular file")
    try:  # a directory made and removed where the first missing one (or the file) would go
        os.rmdir(tempfile.mkdtemp(prefix=".jetrl-probe-", dir=probe))
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise UserError(f"{named}: cannot be created or written ({why}); choose another") from None
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{named}: not writable by this user; choose another")


def output_dir_problem(path: Path, option: str) -> str | None:
    """`check_output_dir`'s refusal as a message, None when ``path`` will do; a regular file at
    ``path`` itself is said as such. For a command that reports every problem at once."""
    if path.exists() and not path.is_dir():
        return f"{option} {path}: is a regular file, not a directory; choose another {option}"
    try:
        check_output_dir(path, option)
    except UserError as exc:
        return str(exc)
    return None


def make_output_dir(path: Path, option: str, for_file: Path | None = None) -> None:
    """`check_output_dir`, then create ``path`` (and its parents) and write a file in it."""
    check_output_dir(path, option, for_file)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        named = _named(path, option, for_file)
        raise UserError(f"{named}: cannot be created or written ({why}); choose another") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(
            f"{_named(path, option, for_file)}: not writable by this user; choose another"
        )
