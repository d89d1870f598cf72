"""scripts/link_packages.py: a distribution and what it requires, hard-linked from one real venv
into another (how the second torch-2.11 vLLM env gets torch without 4.4 GiB more disk), and every
way a source that cannot serve is refused with nothing left behind."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from importlib.metadata import distributions
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import link_packages  # noqa: E402


def _site(root: Path) -> Path:
    (site,) = root.glob("lib/python*/site-packages")
    return site


def _dist(site: Path, name: str, version: str, files: dict[str, str], requires=(), scripts=()):
    """A wheel-installed distribution: its files, a RECORD listing them, METADATA, entry points."""
    info = f"{name}-{version}.dist-info"
    meta = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    records = dict(files)
    records[f"{info}/METADATA"] = "\n".join(meta) + "\n"
    if scripts:
        eps = "\n".join(f"{n} = {target}" for n, target in scripts)
        records[f"{info}/entry_points.txt"] = f"[console_scripts]\n{eps}\n"
    for rel, text in records.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    listed = [*records, f"{info}/RECORD", *(f"../../../bin/{n}" for n, _ in scripts)]
    (site / info / "RECORD").write_text("".join(f"{r},,\n" for r in listed))


@pytest.fixture
def venvs(tmp_path: Path) -> tuple[Path, Path]:
    src, dst = tmp_path / "src", tmp_path / "dst"
    for root in (src, dst):
        venv.create(root, with_pip=False)  # real venvs of this Python, no pip: fast
    site = _site(src)
    _dist(site, "alpha", "1.0",
          {"alpha/__init__.py": "", "alpha/cli.py": "def main():\n    print('alpha says hi')\n"},
          requires=["beta[x]>=2", "gamma; extra == 'docs'", "zeta; sys_platform == 'nowhere'"],
          scripts=[("alpha-cli", "alpha.cli:main")])  # fmt: skip
    _dist(site, "beta", "2.1", {"beta.py": "B = 2\n", "ns/__init__.py": ""},
          requires=["eps==0.1; extra == 'x'"])  # fmt: skip
    _dist(site, "eps", "0.1", {"eps/lib.so": "x" * 4096, "ns/__init__.py": ""})
    for unrelated in ("gamma", "zeta", "omega"):  # an extra not asked, a marker false, no link
        _dist(site, unrelated, "1.0", {f"{unrelated}.py": ""})
    # the source's bin/alpha-cli names the source's interpreter: never linked
    (src / "bin" / "alpha-cli").write_text(f"#!{src}/bin/python\nraise SystemExit('wrong env')\n")
    return src, dst


def _link(capsys, *args: object) -> SimpleNamespace:
    """The script's command line, run in this process: exit status, stdout, stderr."""
    rc = link_packages.main([str(a) for a in args])
    out = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)


def _names(site: Path) -> dict[str, str]:
    return {d.metadata["Name"]: d.version for d in distributions(path=[str(site)])}


def test_the_closure_is_linked_file_by_file_and_the_scripts_are_the_targets_own(
    venvs, capsys
) -> None:
    src, dst = venvs
    done = _link(capsys, src, dst, "alpha==1.0")
    assert done.returncode == 0, done.stderr
    assert "3 distributions, 12 files" in done.stdout, done.stdout  # ns/__init__.py once
    site_s, site_d = _site(src), _site(dst)
    assert _names(site_d) == {"alpha": "1.0", "beta": "2.1", "eps": "0.1"}  # extras followed
    for rel in (
        "alpha/cli.py",
        "beta.py",
        "eps/lib.so",
        "ns/__init__.py",
        "beta-2.1.dist-info/RECORD",
    ):
        assert (site_d / rel).samefile(site_s / rel), rel  # the same inode: no new disk
    cli = dst / "bin" / "alpha-cli"
    assert cli.read_text().startswith(f"#!{dst}/bin/python\n")
    ran = subprocess.run([str(cli)], capture_output=True, text=True)
    assert (ran.returncode, ran.stdout) == (0, "alpha says hi\n"), ran.stderr
    again = _link(capsys, src, dst, "alpha==1.0")  # idempotent
    assert again.returncode == 0 and "already has alpha==1.0" in again.stdout


@pytest.mark.parametrize("spec, ok", [("kappa==2.13.0", True), ("kappa==2.13.0+cu130", False)])
def test_a_local_version_label_fits_as_pep_440_says(venvs, capsys, spec: str, ok: bool) -> None:
    src, dst = venvs  # .venv's torch 2.13.0+cpu serves the vLLM env's pin torch==2.13.0
    _dist(_site(src), "kappa", "2.13.0+cpu", {"kappa.py": ""})
    done = _link(capsys, src, dst, spec)
    assert done.returncode == (0 if ok else 1), done.stderr
    assert (_names(_site(dst)) == {"kappa": "2.13.0+cpu"}) == ok


def test_a_distribution_the_target_has_in_a_version_that_does_not_fit_is_left_for_pip(
    venvs, capsys
) -> None:
    src, dst = venvs
    _dist(_site(dst), "beta", "1.0", {"beta.py": "B = 1\n"})
    done = _link(capsys, src, dst, "alpha==1.0")
    assert done.returncode == 0, done.stderr
    assert f"left for pip: {dst} has beta 1.0, beta[x]>=2" in done.stdout
    assert _names(_site(dst)) == {"alpha": "1.0", "beta": "1.0", "eps": "0.1"}
    assert (_site(dst) / "beta.py").read_text() == "B = 1\n"


def test_a_distribution_the_target_has_in_a_fitting_version_is_kept(venvs, capsys) -> None:
    src, dst = venvs
    _dist(_site(dst), "beta", "2.5", {"beta.py": "B = 25\n"}, requires=["eps==0.1; extra == 'x'"])
    assert _link(capsys, src, dst, "alpha==1.0").returncode == 0
    assert _names(_site(dst)) == {"alpha": "1.0", "beta": "2.5", "eps": "0.1"}
    assert (_site(dst) / "beta.py").read_text() == "B = 25\n"


@pytest.mark.parametrize(
    "case, spec, message",
    [
        ("other version", "alpha==2.0", "alpha==2.0 wanted, the source has 1.0"),
        ("absent", "nothing==1.0", "nothing==1.0 wanted, the source has absent"),
        ("requirement missing", "alpha==1.0", "beta requires eps==0.1; extra == \"x\", the source has absent"),
        ("a file in the way", "alpha==1.0", "exists and is not"),
        ("source damaged", "alpha==1.0", "is in eps's RECORD but absent"),
    ],
)  # fmt: skip
def test_a_source_that_cannot_serve_is_refused_and_nothing_stays_linked(
    venvs, capsys, case: str, spec: str, message: str
) -> None:
    src, dst = venvs
    site_s, site_d = _site(src), _site(dst)
    if case == "requirement missing":
        shutil.rmtree(site_s / "eps-0.1.dist-info")
    elif case == "a file in the way":
        (site_d / "ns").mkdir()
        (site_d / "ns" / "__init__.py").write_text("# mine\n")
    elif case == "source damaged":
        (site_s / "eps" / "lib.so").unlink()
    before = sorted(p.relative_to(dst) for p in dst.rglob("*"))
    done = _link(capsys, src, dst, spec)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert message in done.stderr, done.stderr
    assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == before, case  # nothing left


def test_bad_arguments_exit_2(capsys) -> None:
    done = _link(capsys, "a", "b", "torch")
    assert done.returncode == 2 and "NAME==VERSION" in done.stderr
