"""The driver and every Ray worker of a NeMo-RL launch run the same nemo_jetrl sources
(`build_info`: `source_digest`, `shadowing_checkout`, `mark_driver_code`, `driver_code_problem`).

NeMo-RL's ``init_ray`` starts Ray without a ``working_dir``, and Ray then puts the driver's working
directory on every worker's sys.path: launched from a checkout (``slurm/launch.sh`` cds into the
clone), the workers import the checkout's nemo_jetrl while the ``jetrl`` console script imports
the installed one (found by reading Ray's ``worker.py`` and NeMo-RL's ``init_ray``, 2026-12-01).
The image sets ``JETRL_COMMIT`` for every process, so commits cannot tell the two apart; digests
of the sources can. Here: a checkout with the same sources passes, one edited file is refused
before Ray starts (exit 2 through `driver.prepare_master`, naming both places), and a worker whose
sources differ from the recorded driver's refuses to start (the Megatron worker and our vLLM
plugin call `driver_code_problem`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import nemo_jetrl
from nemo_jetrl import build_info
from nemo_jetrl.backends.nemo_rl import driver
from nemo_jetrl.errors import UserError
from nemo_jetrl.vllm_patch import plugin

PACKAGE = Path(nemo_jetrl.__file__).resolve().parent


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of this package's sources in a directory of its own (as a clone would hold)."""
    root = tmp_path_factory.mktemp("clone")
    shutil.copytree(PACKAGE, root / "nemo_jetrl", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_the_digest_covers_the_sources_not_where_they_are(checkout, tmp_path):
    assert build_info.source_digest(checkout / "nemo_jetrl") == build_info.source_digest()
    edited = tmp_path / "nemo_jetrl"
    shutil.copytree(checkout / "nemo_jetrl", edited)
    (edited / "recipe.py").write_text((edited / "recipe.py").read_text() + "\n# edited\n")
    assert build_info.source_digest(edited) != build_info.source_digest()
    (edited / "recipe.py").write_text((PACKAGE / "recipe.py").read_text())
    assert build_info.source_digest(edited) == build_info.source_digest()
    (edited / "recipe.py").rename(edited / "recipe2.py")  # same bytes, same order, new name
    assert build_info.source_digest(edited) != build_info.source_digest()
    (edited / "recipe2.py").unlink()  # a file less is other sources too
    assert build_info.source_digest(edited) != build_info.source_digest()


def test_a_launch_from_a_checkout_with_other_sources_is_refused_before_ray(
    checkout, tmp_path, monkeypatch
):
    assert build_info.shadowing_checkout(checkout) is None  # the same sources: harmless
    assert build_info.shadowing_checkout(PACKAGE.parent) is None  # the driver's own directory
    assert build_info.shadowing_checkout(tmp_path) is None  # no nemo_jetrl there
    edited = tmp_path / "edited"
    shutil.copytree(checkout, edited)
    (edited / "nemo_jetrl" / "recipe.py").write_text("# edited\n")
    why = build_info.shadowing_checkout(edited)
    assert why is not None and str(edited / "nemo_jetrl") in why and str(PACKAGE) in why
    assert "nothing started" in why
    environ: dict[str, str] = {}
    monkeypatch.chdir(edited)  # the process's working directory: the one Ray hands the workers
    with pytest.raises(UserError, match="Ray puts the driver's working directory"):
        driver.prepare_master(
            {}, {}, nemo_rl_dir=tmp_path, venv_base=tmp_path / "venvs", stock_entry="python",
            vllm_entry="python", vllm_patch=False, environ=environ,
            next_log_dir=lambda d: d, preflight=lambda _: None, cwd=tmp_path,
        )  # fmt: skip
    assert environ == {}  # refused before anything was recorded or started


def test_a_worker_with_other_sources_than_the_driver_refuses_to_start(monkeypatch):
    environ: dict[str, str] = {}
    value = build_info.mark_driver_code(environ)
    assert value == f"{build_info.source_digest()} {PACKAGE}"
    assert build_info.driver_code_problem("worker", environ) is None  # the same sources
    assert build_info.driver_code_problem("worker", {}) is None  # not a NeMo-RL launch
    other = {build_info.DRIVER_CODE_ENV: "0123456789ab /opt/venv/site-packages/nemo_jetrl"}
    why = build_info.driver_code_problem("NeMo-RL's Megatron policy worker", other)
    assert why is not None and "/opt/venv/site-packages/nemo_jetrl (sources 0123456789ab)" in why
    assert str(PACKAGE) in why and why.startswith("NeMo-RL's Megatron policy worker imports")
    # our vLLM plugin, as vLLM calls it in each process it starts
    monkeypatch.setenv(build_info.DRIVER_CODE_ENV, other[build_info.DRIVER_CODE_ENV])
    with pytest.raises(RuntimeError, match="a vLLM process of the rollout imports nemo_jetrl"):
        plugin.load_in_worker()
    monkeypatch.setenv(build_info.DRIVER_CODE_ENV, value)
    plugin.load_in_worker()  # the same sources: on to the patch (none asked for here)


def test_every_python_source_is_in_a_package_so_a_wheel_carries_it():
    """The image installs nemo_jetrl as a wheel (docker/Dockerfile), the clone holds the sources;
    their digests agree only if the wheel carries every ``.py``. pyproject's
    ``packages.find`` takes regular packages only, so a folder of modules without
    ``__init__.py`` would be left out of the wheel and every launch from a clone refused
    (checked 2026-12-01: a wheel built from this tree had the source digest)."""
    loose = sorted(
        p.parent.relative_to(PACKAGE.parent).as_posix()
        for p in PACKAGE.rglob("*.py")
        if "__pycache__" not in p.parts and not (p.parent / "__init__.py").is_file()
    )
    assert loose == [], f"add __init__.py to {sorted(set(loose))}"
