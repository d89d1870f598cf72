"""Install a distribution into a venv by hard-linking it from a sibling venv that already has it.

Why: the vLLM 0.20 and 0.25 environments both need PyPI's torch 2.11.0 (a CUDA build that runs on
the CPU), which with its nvidia-*, cuda-* and triton wheels is ~4.4 GB installed. Written twice,
plus the wheelhouse it came from, a CI run needed ~22 GB of disk, and one run on a machine with
less free died of "No space left on device" in every tier after the first (docs/ci_times.md).
Linked, the second environment's copy costs directory entries only.

What it does: in SRC's site-packages, the distribution named by SPEC (``torch==2.11.0``; matched
as PEP 440 says, so ``torch==2.13.0`` takes 2.13.0+cpu) and every installed distribution it
requires, following extras and this machine's markers, are linked file by file into DST's
site-packages, exactly the files each
distribution's RECORD lists (its .dist-info included, so pip and importlib.metadata see it as
installed). RECORD entries outside site-packages (console scripts in bin/) are not linked: their
first line names SRC's interpreter; DST gets its own, written for DST's Python. A file is the same
inode in both venvs, which is safe because pip and Python never write an installed file in place
(an upgrade or uninstall in one venv unlinks that venv's name only).

A distribution of that closure DST already has stays DST's; where its version does not fit
(Python 3.11's venv seeds setuptools 65.5, torch 2.13 asks for >= 77.0.3) it is named on stdout,
and the caller's `pip install SPEC` afterwards settles it (torch is then already there).

Exit 0: linked (or DST already had that version). Exit 1: SRC cannot serve (not that version, a
required distribution missing, another filesystem); anything linked is removed again, so the
caller can fall back to a download. Exit 2: bad arguments.

Usage: python scripts/link_packages.py SRC_VENV DST_VENV NAME==VERSION
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from importlib.metadata import Distribution, distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


class CannotLink(Exception):
    """SRC cannot serve this request; the caller falls back to installing the usual way."""


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python*/site-packages"))
    if len(found) != 1:
        raise CannotLink(f"{venv}: expected one lib/python*/site-packages, found {len(found)}")
    return found[0]


def installed(site: Path) -> dict[str, Distribution]:
    return {canonicalize_name(d.metadata["Name"]): d for d in distributions(path=[str(site)])}


def fits(req: Requirement, version: str) -> bool:
    """PEP 440: ``torch==2.13.0`` fits 2.13.0+cpu (a local label is ignored unless named)."""
    return req.specifier.contains(version, prereleases=True)


def closure(
    have: dict[str, Distribution], want: Requirement
) -> tuple[list[Distribution], dict[str, list[Requirement]]]:
    """WANT's distribution and what it requires for this machine (extras followed), all in
    HAVE, with the requirements naming each of them."""
    root = have.get(canonicalize_name(want.name))
    if root is None or not fits(want, root.version):
        got = "absent" if root is None else root.version
        raise CannotLink(f"{want} wanted, the source has {got}")
    todo: list[tuple[Distribution, frozenset[str]]] = [(root, frozenset())]
    seen: dict[str, set[str]] = {}
    asked: dict[str, list[Requirement]] = {}
    while todo:
        dist, extras = todo.pop()
        key = canonicalize_name(dist.metadata["Name"])
        if key in seen and extras <= seen[key]:
            continue
        seen.setdefault(key, set()).update(extras)
        for line in dist.requires or []:
            req = Requirement(line)
            wanted = [{"extra": e} for e in ("", *extras)]
            if req.marker is not None and not any(req.marker.evaluate(m) for m in wanted):
                continue
            dep = have.get(canonicalize_name(req.name))
            if dep is None or not fits(req, dep.version):
                got = "absent" if dep is None else dep.version
                raise CannotLink(f"{dist.metadata['Name']} requires {req}, the source has {got}")
            asked.setdefault(canonicalize_name(req.name), []).append(req)
            todo.append((dep, frozenset(req.extras)))
    return [have[k] for k in sorted(seen)], asked


def console_script(python: Path, target: str) -> str:
    module, _, attr = target.partition(":")
    call = attr.strip() or "main"
    head, _, rest = call.partition(".")
    return (
        f"#!{python}\nimport sys\nfrom {module.strip()} import {head}\n"
        f"sys.exit({head}{'.' + rest if rest else ''}())\n"
    )


def link(src_venv: Path, dst_venv: Path, spec: str) -> tuple[int, int, int]:
    """Link SPEC's closure from SRC_VENV into DST_VENV: (distributions, files, bytes)."""
    want = Requirement(spec)
    src, dst = site_packages(src_venv), site_packages(dst_venv)
    present = installed(dst)
    already = present.get(canonicalize_name(want.name))
    if already is not None and fits(want, already.version):
        return 0, 0, 0
    if already is not None:
        raise CannotLink(f"{dst_venv} has {want.name} {already.version}: uninstall it first")
    dists, asked = closure(installed(src), want)
    linked = []
    for dist in dists:  # one DST already has (the venv's own setuptools) stays: pip settles it
        key = canonicalize_name(dist.metadata["Name"])
        own = present.get(key)
        if own is None:
            linked.append(dist)
        elif not all(fits(r, own.version) for r in asked[key]):
            wants = ", ".join(str(r) for r in asked[key])
            print(f"[link_packages] left for pip: {dst_venv} has {key} {own.version}, {wants}")
    made: list[Path] = []
    files = size = 0
    try:
        for dist in linked:
            for entry in dist.files or []:
                source = (src / entry).resolve()
                if src.resolve() not in source.parents:  # bin/ scripts: written below
                    continue
                target = dst / entry
                if not source.is_file():
                    if "__pycache__" in entry.parts:
                        continue  # bytecode RECORD lists but nobody wrote: Python makes it
                    raise CannotLink(f"{source} is in {dist.metadata['Name']}'s RECORD but absent")
                if target.exists():  # a file two linked distributions list (nvidia/__init__.py)
                    if target.samefile(source):
                        continue
                    raise CannotLink(f"{target} exists and is not {source}")
                missing = [d for d in (target.parent, *target.parent.parents) if not d.exists()]
                target.parent.mkdir(parents=True, exist_ok=True)
                made.extend(reversed(missing))
                try:
                    os.link(source, target)
                except OSError as e:
                    raise CannotLink(f"cannot link {source} -> {target}: {e}") from e
                made.append(target)
                files += 1
                size += target.stat().st_size
            for ep in dist.entry_points.select(group="console_scripts"):
                script = dst_venv / "bin" / ep.name
                if not script.exists():
                    script.write_text(console_script(dst_venv / "bin" / "python", ep.value))
                    script.chmod(0o755)
                    made.append(script)
    except BaseException:
        for path in reversed(made):  # nothing half-linked stays behind
            with contextlib.suppress(OSError):  # a directory written into meanwhile stays
                path.rmdir() if path.is_dir() else path.unlink(missing_ok=True)
        raise
    return len(linked), files, size


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!_-]+", argv[2]):
        print("usage: link_packages.py SRC_VENV DST_VENV NAME==VERSION", file=sys.stderr)
        return 2
    src_venv, dst_venv, spec = Path(argv[0]), Path(argv[1]), argv[2]
    try:
        n, files, size = link(src_venv, dst_venv, spec)
    except CannotLink as e:
        print(f"[link_packages] {src_venv} cannot serve {spec}: {e}", file=sys.stderr)
        return 1
    if n == 0:
        print(f"[link_packages] {dst_venv} already has {spec}")
    else:
        print(
            f"[link_packages] {spec}: {n} distributions, {files} files, {size / 2**30:.2f} GiB "
            f"linked from {src_venv} into {dst_venv} (no new disk used)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
