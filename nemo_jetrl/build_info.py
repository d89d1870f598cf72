"""Which nemo_jetrl this is: its version and the commit it was built from.

The image is built from a copy without ``.git`` (docker/Dockerfile.dockerignore), so the commit
comes in as the ``JETRL_COMMIT`` build argument and is written to ``COMMIT`` next to the package
(``$JETRL_DIR/COMMIT``) and kept in the environment. Order: ``$JETRL_COMMIT``, the ``COMMIT`` file
beside the package's source tree, ``git rev-parse`` in a source checkout, else ``unknown``.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from nemo_jetrl import __version__

COMMIT_ENV = "JETRL_COMMIT"
COMMIT_FILE = "COMMIT"


def commit(environ: Mapping[str, str] | None = None, source: Path | None = None) -> str:
    env = os.environ if environ is None else environ
    if env.get(COMMIT_ENV, "").strip():
        return env[COMMIT_ENV].strip()
    root = source or Path(__file__).resolve().parents[1]
    for d in (root, Path(env.get("JETRL_DIR", "/opt/nemo-jetrl"))):
        f = d / COMMIT_FILE
        if f.is_file() and f.read_text().strip():
            return f.read_text().strip()
    if (root / ".git").exists():
        try:
            out = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.SubprocessError):
            return "unknown"
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return "unknown"


def version_line(environ: Mapping[str, str] | None = None) -> str:
    """``nemo_jetrl 0.1.0 (commit 696f711...)``: in ``jetrl --version`` and the launch log."""
    return f"nemo_jetrl {__version__} (commit {commit(environ)})"
