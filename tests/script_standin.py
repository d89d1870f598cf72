"""Shared by the tests of the test scripts: the repository root, and the stand-in repository that
tests/test_test_sh_environments.py and tests/test_test_sh_lanes.py run scripts/test.sh on."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# -- scripts/test.sh's control flow, on a stand-in repository ---------------------------------
# test.sh and tier.sh are the real scripts; every program they start (setup scripts, pytest, the
# tier scripts) is a labelled stand-in that logs "start NAME" / "end NAME" to a journal, so the
# order, the overlap of environment builds with the default suite and the summary are observable.
_STANDIN = """#!/usr/bin/env bash
# stand-in for {name} (tests/script_standin.py)
echo "start {name} $* ${{VLLM_VENV:-}}" >> "$JOURNAL"
# the lists of passed tests test.sh hands to each tier and to the mutation check
[ -z "${{JETRL_PASSED_LOG:-}}" ] || echo "{name} ${{VLLM_VENV:-}}${{1:-}} ${{JETRL_PASSED_LOG##*/}}" >> "$JOURNAL.passed"
[ -z "${{JETRL_PASSED_DIR:-}}" ] || echo "{name} $* reads $(basename "$JETRL_PASSED_DIR")" >> "$JOURNAL.passed"
echo "$$" >> "$JOURNAL.pids"
sleep "${{STANDIN_SLEEP_{key}:-0}}"
echo "end {name} ${{VLLM_VENV:-}}" >> "$JOURNAL"
{tail}
"""


def _standin_repo(tmp_path: Path, fail: str = "") -> Path:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("test.sh", "tier.sh", "nemo_rl_env.sh"):
        (root / "scripts" / name).write_text((REPO / "scripts" / name).read_text())
    tails = {
        "setup_env": "",
        "setup_vllm_env": '[ "$VLLM_VERSION" != "{f}" ] || '
        '{{ echo "${{STANDIN_FAIL_MESSAGE:-setup $VLLM_VERSION failed}}" >&2; false; }}',
        "fetch_vllm_src": "",
        "setup_nemo_rl_env": "",
        "test_vllm": 'echo "== 3 passed in 1s =="',
        "test_nemo_rl": 'echo "== 2 passed in 1s =="',
    }
    for name, tail in tails.items():
        p = root / "scripts" / f"{name}.sh"
        p.write_text(_STANDIN.format(name=name, key=name.upper(), tail=tail.format(f=fail)))
    py = root / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(_STANDIN.format(name="default-python", key="PY", tail='echo "== 5 passed =="'))
    py.chmod(0o755)
    for tree in ("v0.7.0", "main-abc"):
        (tmp_path / "upstream" / tree / "nemo_rl").mkdir(parents=True)
    return root


def _test_sh_env(tmp_path: Path, **env: str) -> dict[str, str]:
    """test.sh's environment in a stand-in run: temp files, journal (``tmp_path / "journal"``)
    and the stand-in upstream trees under ``tmp_path``, then ``env``."""
    # the caller's own tier knobs (e.g. `JETRL_SKIP_VLLM=1 bash scripts/test.sh`) stay out
    mine = (
        "JETRL_SKIP_",
        "JETRL_TIER_",
        "JETRL_TEST_WORKERS",
        "JETRL_VLLM_VERSIONS",
        "JETRL_PASSED_",
    )
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(mine)},
        "TMPDIR": str(tmp_path),
        "JOURNAL": str(tmp_path / "journal"),
        "JETRL_NEMO_RL_UPSTREAM": str(tmp_path / "upstream"),
        **env,
    }


def _run_test_sh(tmp_path: Path, fail: str = "", **env: str) -> tuple[list[str], list[str], str]:
    root = tmp_path / "repo" if (tmp_path / "repo").is_dir() else _standin_repo(tmp_path, fail)
    journal = tmp_path / "journal"
    done = subprocess.run(
        ["bash", "scripts/test.sh"],
        cwd=root,
        env=_test_sh_env(
            tmp_path, **{"JETRL_NEMO_RL_TREES": "v0.7.0 main-abc", "CI": "true", **env}
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    summary = done.stdout.split("== summary ==\n", 1)[1].splitlines()
    return summary, journal.read_text().splitlines(), done.stdout + done.stderr


def _at(journal: list[str], prefix: str) -> int:
    """Index of the first journal line starting with ``prefix``."""
    return next(i for i, ln in enumerate(journal) if ln.startswith(prefix))
