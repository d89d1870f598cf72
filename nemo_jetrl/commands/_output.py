"""Output paths of the `jetrl` subcommands: created and probed before any work, so a path the
process cannot write is an exit-2 message naming the option, never a traceback afterwards."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from nemo_jetrl.errors import UserError


def make_output_dir(path: Path, option: str, for_file: Path | None = None) -> None:
    """Create directory ``path`` (and its parents) and check a file can be written in it;
    ``for_file``: the output file the user named, whose directory ``path`` is (for messages).

    ``os.access`` alone is not enough: it answers yes for root on /proc and /sys, where
    creating anything then fails."""
    named = f"{option} {for_file}: its directory {path}" if for_file else f"{option} {path}"
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UserError(f"{named}: cannot be created, {probe} is a regular file")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise UserError(f"{named}: cannot be created or written ({why}); choose another") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{named}: not writable by this user; choose another")
