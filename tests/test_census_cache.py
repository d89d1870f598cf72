"""`scripts/census_cache.py unpack`, as a GPU call runs it before its first step: the sm_90 census
cache is unpacked as filed when this Triton computes the key it was packed under, filed again under
this Triton's key when only libtriton's build differs (Triton then finds each kernel where it
looks), and not unpacked otherwise, with a line naming what differs. The census's own packing and
a real replay of all its kernels: tests/test_sm90_census.py."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import census_cache  # noqa: E402

triton_cache = pytest.importorskip("triton.runtime.cache")  # the dev extra installs Triton


def _carry(tmp_path: Path, root: Path, **changes: str) -> Path:
    """A census cache of one kernel (folder K, tail "-tail") made for this Triton, then ``changes``
    to its CENSUS.json (triton_key, libtriton_sha256, triton, backend_hash)."""
    import triton

    meta = {"triton": triton.__version__, "libtriton_sha256": census_cache.libtriton_sha256(),
            "triton_key": triton_cache.triton_key(), "backend_hash": census_cache.backend_hash(),
            "tails": {"K": "-tail"}, "root": str(root), **changes}  # fmt: skip
    files = {"K/k_kernel.json": json.dumps({"hash": "0" * 64, "name": "k_kernel"}).encode(),
             "K/k_kernel.cubin": b"\x7fELF cubin"}  # fmt: skip
    tarball = tmp_path / "census.tar.gz"
    assert census_cache._write(tarball, files, str(root), meta) == 1
    return tarball


def _found_by_triton(root: Path, key: str, monkeypatch) -> dict:  # type: ignore[no-untyped-def]
    """The files Triton's cache manager returns for a kernel of this full key, as compile() asks."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(root))
    sha = hashlib.sha256(key.encode()).hexdigest()
    return triton_cache.get_cache_manager(sha).get_group("k_kernel.json") or {}


def test_the_same_key_is_unpacked_as_filed(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    line = census_cache.unpack(_carry(tmp_path, root), root)
    assert line.endswith("(the same: expect hits)"), line
    assert (root / "K" / "k_kernel.cubin").read_bytes() == b"\x7fELF cubin"
    index = json.loads((root / "K" / "__grp__k_kernel.json").read_text())["child_paths"]
    assert index == {n: f"{root}/K/{n}" for n in ("k_kernel.cubin", "k_kernel.json")}


def test_another_build_of_libtriton_is_re_keyed_where_triton_looks(tmp_path, monkeypatch):
    """Packed under another libtriton's hash (the image's cp312 wheel, as the census does): filed
    again under this Triton's key; Triton's own cache manager then finds the kernel, whose metadata
    names the new key's sha256. Without re-keying (JETRL_CENSUS_REKEY=0): not unpacked."""
    here = census_cache.libtriton_sha256()
    other = "f" * 64
    key = triton_cache.triton_key()
    root = tmp_path / "cache"
    tarball = _carry(tmp_path, root, triton_key=key.replace(here, other), libtriton_sha256=other)
    line = census_cache.unpack(tarball, root)
    assert "(re-keyed: another build of Triton" in line and "1 kernels filed under" in line, line
    assert not (root / "K").exists()
    found = _found_by_triton(root, key + "-tail", monkeypatch)
    assert set(found) == {"k_kernel.json", "k_kernel.cubin"}, sorted(root.iterdir())
    assert Path(found["k_kernel.cubin"]).read_bytes() == b"\x7fELF cubin"
    meta = json.loads(Path(found["k_kernel.json"]).read_text())
    assert meta == {
        "hash": hashlib.sha256((key + "-tail").encode()).hexdigest(),
        "name": "k_kernel",
    }
    assert _found_by_triton(root, key.replace(here, other) + "-tail", monkeypatch) == {}

    off = tmp_path / "off"
    line = census_cache.unpack(_carry(tmp_path, off, triton_key=key.replace(here, other),
                                      libtriton_sha256=other), off, rekey=False)  # fmt: skip
    assert "(differs: re-keying is off (JETRL_CENSUS_REKEY=0); not unpacked" in line, line
    assert not off.exists()


def _segments_changed(key: str, index: int) -> str:
    parts = key.split("-")
    parts[index] = "0" * 64
    return "-".join(parts)


@pytest.mark.parametrize(
    "change, said",
    [
        ({"triton": "0.0.1"}, "differs: Triton {ver}, not 0.0.1"),
        (
            {"triton_key": "SOURCE"},
            "differs: Triton's Python sources: 1 of its hashed files differ",
        ),
        ({"backend_hash": "0.0-90"}, "differs: ptxas {backend} here, 0.0-90 in the census's"),
    ],
    ids=["version", "python-source", "ptxas"],
)
def test_what_differs_is_named_and_nothing_is_unpacked(tmp_path, change, said):
    import triton

    if change.get("triton_key") == "SOURCE":  # one hashed Python file of Triton's, not libtriton
        key, here = triton_cache.triton_key(), census_cache.libtriton_sha256()
        index = next(i for i, p in enumerate(key.split("-")) if i > 0 and p != here)
        change = {"triton_key": _segments_changed(key, index)}
    root = tmp_path / "cache"
    line = census_cache.unpack(_carry(tmp_path, root, **change), root)
    want = said.format(
        ver=triton.__version__, backend=census_cache._short(census_cache.backend_hash())
    )
    assert want in line and "not unpacked: expect every kernel compiled here" in line, line
    assert not root.exists()


def test_the_cli_says_one_line_and_never_stops_the_call(tmp_path):
    """Packed for another folder (Triton's index holds absolute paths): not used; a broken
    tarball: not used, with the error; exit 0 either way (the call goes on compiling)."""
    root = tmp_path / "cache"
    tarball = _carry(tmp_path, tmp_path / "elsewhere")
    cli = [sys.executable, str(REPO / "scripts" / "census_cache.py"), "unpack"]
    p = subprocess.run([*cli, str(tarball), str(root)], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == (
        f"sm90 census cache: not used (packed for {tmp_path / 'elsewhere'}, "
        f"TRITON_CACHE_DIR is {root})\n"
    ), p.stdout + p.stderr
    (tmp_path / "broken.tar.gz").write_bytes(b"not a tarball")
    p = subprocess.run([*cli, str(tmp_path / "broken.tar.gz"), str(root)], capture_output=True,
                       text=True)  # fmt: skip
    assert p.returncode == 0 and p.stdout.startswith("sm90 census cache: not used (ReadError"), (
        p.stdout
    )
    assert subprocess.run([*cli, "x"], capture_output=True).returncode == 2
