"""The test environments' locks (scripts/locks/*.txt, docs/testing.md): one per environment the
setup scripts build, exact pins only, consistent with what the project asks for, and in effect in
the environment this suite runs in."""

from __future__ import annotations

import re
import sys
import sysconfig
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
    """Every locked package installed in this interpreter's environment is at the locked version
    (the default suite runs in .venv, which scripts/setup_env.sh builds against default.txt).
    Only the environment's own site-packages are read: importing setuptools appends its
    ``setuptools/_vendor`` to sys.path, whose vendored ``packaging-26.3.dist-info`` CI's run once
    reported as off-lock beside .venv's locked 26.4 (a test on that worker had imported it)."""
    import setuptools  # noqa: F401  (as some test before this one may: the vendored dists join sys.path)

    pins = _pins(LOCKS / "default.txt")
    site = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    assert all(Path(d).is_relative_to(sys.prefix) for d in site), (site, sys.prefix)
    off = {}
    for dist in metadata.distributions(path=site):
        name = canonicalize_name(dist.metadata["Name"])
        if name in pins and dist.version != pins[name]:
            off[name] = (dist.version, pins[name], str(dist.locate_file("")))
    assert not off, (
        f"installed vs locked (version, lock, where): {off}; rebuild .venv or rewrite the lock"
    )
    assert metadata.version("pytest") == pins["pytest"]  # the lock names what runs this test


def _pip_calls(script: Path) -> list[str]:
    """Every pip install/download command of a setup script, continuation lines joined."""
    text = script.read_text().replace("\\\n", " ")
    calls = []
    for line in text.splitlines():
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        if re.search(r"pip_retry\s.*\s(install|download)\s|\"\$\{PIP\[@\]\}\"", code):
            calls.append(code.strip())
    return calls


def test_every_pip_call_that_resolves_dependencies_reads_the_lock():
    """A download or install that pulls in dependencies without the lock takes whatever PyPI has
    today: the vLLM 0.20 wheelhouse download once took filelock 4.3.2 while the lock said 4.3.1,
    and the --no-index install from it then had no candidate (every NeMo-RL tier lost its env)."""
    setup_vllm = (REPO / "scripts/setup_vllm_env.sh").read_text()
    assert re.search(
        r'^PIP=\(pip_retry "\$VENV/bin/python" install .*-c "\$LOCK"\)', setup_vllm, re.M
    )
    checked = 0
    for name in ("setup_env.sh", "setup_vllm_env.sh", "setup_nemo_rl_env.sh"):
        for call in _pip_calls(REPO / "scripts" / name):
            checked += 1
            if "--no-deps" in call:
                continue  # one named, pinned package, nothing resolved
            assert '-c "$LOCK"' in call or '"${PIP[@]}"' in call, f"{name}: {call}"
    assert checked >= 12, checked
