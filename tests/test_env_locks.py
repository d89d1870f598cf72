"""The test environments' locks (scripts/locks/*.txt, docs/testing.md): one per environment the
setup scripts build, exact pins only, consistent with what the project asks for, and in effect in
the environment this suite runs in."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "scripts" / "locks"
sys.path.insert(0, str(REPO / "scripts"))
from lock_envs import ENVS, LEFT_OUT  # noqa: E402


def _pins(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # one exact pin per line
        assert spec.operator == "==" and "*" not in spec.version, (path.name, line)
        name = canonicalize_name(req.name)
        assert name not in pins, (path.name, name)  # listed once
        pins[name] = spec.version
    return pins


def test_every_env_the_setup_scripts_build_has_a_lock_of_exact_pins():
    versions = re.findall(
        r"^\s+([0-9][0-9.|*]+)\)", (REPO / "scripts/setup_vllm_env.sh").read_text(), re.M
    )
    supported = {v for alt in versions for v in alt.split("|")}
    assert supported == {"0.32.*", "0.20.0", "0.25.1"}, supported
    names = set(ENVS.values())
    assert {"default", "vllm-0.32.0", "vllm-0.20.0", "vllm-0.25.1"} == names
    assert (
        'LOCK="$REPO/scripts/locks/vllm-$VLLM_VERSION.txt"'
        in (REPO / "scripts/setup_vllm_env.sh").read_text()
    )
    assert "LOCK=scripts/locks/default.txt" in (REPO / "scripts/setup_env.sh").read_text()
    for name in names:
        pins = _pins(LOCKS / f"{name}.txt")
        assert len(pins) > 50, name
        assert not LEFT_OUT & set(pins), name  # torch's build is the setup scripts' choice


def test_the_default_lock_fits_every_requirement_of_ours():
    """A pin outside a requirement's range makes pip refuse the install: caught here first."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs = [
        *project["dependencies"],
        *(r for e in ("dev", "local", "megatron", "triton") for r in extras[e]),
    ]
    pins = _pins(LOCKS / "default.txt")
    checked = 0
    for line in reqs:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name in pins and name not in LEFT_OUT:
            assert req.specifier.contains(pins[name], prereleases=True), (line, pins[name])
            checked += 1
        elif name != "nemo-jetrl":  # an extra naming our own extras
            assert name in LEFT_OUT, f"{name}: required but not in the default lock"
    assert checked >= 5, checked


def test_the_lock_is_in_effect_where_this_suite_runs():
    """Every locked package this interpreter has is at the locked version (the default suite
    runs in .venv, which scripts/setup_env.sh builds against default.txt)."""
    pins = _pins(LOCKS / "default.txt")
    off = {}
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in pins and dist.version != pins[name]:
            off[name] = (dist.version, pins[name])
    assert not off, f"installed vs locked: {off}; rebuild .venv or rewrite the lock"
    assert metadata.version("pytest") == pins["pytest"]  # the lock names what runs this test
