"""Which nemo_jetrl this is: its version and the commit it was built from.

The image is built from a copy without ``.git`` (docker/Dockerfile.dockerignore), so the commit
comes in as the ``JETRL_COMMIT`` build argument and is written to ``COMMIT`` next to the package
(``$JETRL_DIR/COMMIT``) and kept in the environment. Order: ``$JETRL_COMMIT``, the ``COMMIT`` file
beside the package's source tree, ``git rev-parse`` in a source checkout, else ``unknown``.

`driver_code_problem`: a Ray worker of a NeMo-RL launch checks that it imports the same nemo_jetrl
sources as the driver (`mark_driver_code`), by digest, not by commit.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Mapping, MutableMapping
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


# -- the same code in the driver and in every Ray worker -----------------------------------------

DRIVER_CODE_ENV = "NEMO_JETRL_DRIVER_CODE"
"""``<source digest> <package dir>`` of the driver's nemo_jetrl, set by the NeMo-RL launch before
Ray starts (NeMo-RL's ``init_ray`` hands the driver's environment to every actor)."""
_PACKAGE = Path(__file__).resolve().parent
_RAY_CWD = (
    "Ray puts the driver's working directory on every worker's sys.path (NeMo-RL starts Ray "
    "without a working_dir)"
)


def source_digest(package: Path | None = None) -> str:
    """sha256 (12 hex digits) of the package's Python sources: their paths and bytes. The same for
    a checkout and a wheel install of it (``JETRL_COMMIT`` is not: the image sets it for every
    process, whatever code a process imports)."""
    root = package or _PACKAGE
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def mark_driver_code(environ: MutableMapping[str, str]) -> str:
    """Record this process's nemo_jetrl in ``environ`` (the driver's, before ``init_ray``)."""
    value = f"{source_digest()} {_PACKAGE}"
    environ[DRIVER_CODE_ENV] = value
    return value


def driver_code_problem(where: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Why ``where`` (a Ray worker) must not run: it imports other nemo_jetrl sources than the
    driver that launched it; None when they are the same or no launch recorded the driver's."""
    value = (os.environ if environ is None else environ).get(DRIVER_CODE_ENV, "").strip()
    if not value:
        return None
    digest, _, driver_dir = value.partition(" ")
    mine = source_digest()
    if mine == digest:
        return None
    return (
        f"{where} imports nemo_jetrl from {_PACKAGE} (sources {mine}) but the driver that "
        f"launched it runs {driver_dir} (sources {digest}): the run would mix two versions of "
        f"our recipe, patch and checks. {_RAY_CWD}, so a nemo_jetrl checkout there shadows the "
        "installed one in the workers only. Start the driver from a directory without a "
        "nemo_jetrl/ package, or install that checkout where the driver and the workers import "
        "it (rebuild the image from it: docs/cluster.md 1a)"
    )


def shadowing_checkout(cwd: Path) -> str | None:
    """Why a NeMo-RL launch from ``cwd`` must not start Ray: ``cwd`` holds a nemo_jetrl package
    whose sources differ from the one this driver imports; Ray would put ``cwd`` on every
    worker's sys.path, so the workers would run it and the driver would not."""
    other = (cwd / "nemo_jetrl").resolve()
    if other == _PACKAGE or not (other / "__init__.py").is_file():
        return None
    theirs, mine = source_digest(other), source_digest()
    if theirs == mine:
        return None
    return (
        f"the working directory {cwd} holds nemo_jetrl sources {theirs} ({other}), this driver "
        f"runs {mine} ({_PACKAGE}). {_RAY_CWD}, so the workers would import the first and the driver the second; nothing started. Install that checkout where the "
        "driver runs (rebuild the image from it: docs/cluster.md 1a), or check out the "
        "installed commit, or launch from another directory"
    )
