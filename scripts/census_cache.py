"""The sm_90 census's kernels carried to a GPU call as a Triton cache, under the key the GPU image
computes (docs/gpu.md, "The census cache").

Triton files a compiled kernel under ``sha256(key)``, where the key is its own identity
(``triton_key()``: the version, a hash of each of its Python sources and of ``libtriton.so``)
followed by a tail that is the kernel's (``-{source and specialization}-{ptxas version and
arch}-{options}-{environment}``). The census runs the GPU image's Triton version from PyPI's
cp311 wheel; the image runs Python 3.12, whose ``libtriton.so`` is another file. So:

- **Packing** (`pack_under_image_key`, `pack_cache`): the census compiles with our
  ``triton_key()`` in which our libtriton's hash is replaced by the image's
  (`IMAGE_LIBTRITON_SHA256`, PyPI's cp312 wheel), and records each kernel's tail.
- **Unpacking on the device** (`unpack`): the image's ``triton_key()`` is computed there.
  Equal to the packed one: unpacked as is ("the same"). Equal except for libtriton's hash (another
  build of the same version: PyTorch's index builds its own Triton wheels) and the same ptxas:
  every kernel is filed again under the image's key ("re-keyed"): the same Python sources turn
  the same kernel into the same PTX, and the same ptxas makes the same cubin; only the build of
  the C++ half differs, and the call's own GPU tests then check the kernels' bits.
  Anything else (another version, another Python source, another ptxas): not unpacked, and the
  line says which part differs. ``JETRL_CENSUS_REKEY=0`` turns re-keying off.

Usage on the device (device_session.sh): ``python scripts/census_cache.py unpack TARBALL ROOT``
prints one line saying which of the three it was.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import tarfile
from pathlib import Path

GPU_IMAGE_TRITON = "3.6.0"  # the lent H100/H200 image's Triton (benchmarks/gpu/results, runs 4-6)
# sha256 of triton/_C/libtriton.so in PyPI's triton-3.6.0 cp312 manylinux wheel (the GPU image's
# Python; `pip download --python-version 3.12 --only-binary=:all: triton==3.6.0`, 2026-11-28).
IMAGE_LIBTRITON_SHA256 = "28daaa70a904e4f8add754e518533e8a69b94ab8b16431ce77d45f1f25282b87"
DEVICE_CACHE_DIR = "/tmp/jetrl-triton-cache"  # device_session.sh's default (it passes its own)


def libtriton_sha256() -> str:
    """sha256 of the imported Triton's ``_C/libtriton.so`` (a part of its cache key)."""
    import triton

    h = hashlib.sha256()
    with (Path(triton.__file__).parent / "_C" / "libtriton.so").open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def dir_name(key: str) -> str:
    """The cache folder Triton files a kernel of this full key under (runtime/cache.py)."""
    from triton.runtime.cache import _base32

    return _base32(hashlib.sha256(key.encode("utf-8")).hexdigest())


def backend_hash() -> str:
    """Triton's sm_90 backend hash (its ptxas version and the arch), part of every kernel's key."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    return make_backend(GPUTarget("cuda", 90, 32)).hash()


class ImageKey:
    """While alive, Triton computes the GPU image's key (our ``triton_key()`` with the image's
    libtriton hash) and `tails` maps each cache folder it files a kernel under to its tail."""

    def __init__(self, image_sha256: str = IMAGE_LIBTRITON_SHA256) -> None:
        import triton.compiler.compiler as compiler
        import triton.runtime.cache as cache

        self.ours, key = libtriton_sha256(), cache.triton_key()
        if self.ours not in key:
            raise SystemExit(
                f"census_cache: Triton {cache.__file__}: its key does not hash libtriton"
            )
        self.image_sha256, self.key = image_sha256, key.replace(self.ours, image_sha256)
        self.tails: dict[str, str] = {}
        cache.triton_key = lambda: self.key  # get_cache_key reads the module's name at each call
        real = compiler.get_cache_key

        def recording(src, backend, options, env_vars):  # type: ignore[no-untyped-def]
            full = real(src, backend, options, env_vars=env_vars)
            assert full.startswith(self.key), (
                "Triton's cache key no longer starts with triton_key()"
            )
            self.tails[dir_name(full)] = full[len(self.key) :]
            return full

        compiler.get_cache_key = recording  # compile() calls it by this module's name

    def meta(self) -> dict:
        """What `unpack` compares on the device (CENSUS.json)."""
        import triton

        return {"triton": triton.__version__, "libtriton_sha256": self.image_sha256,
                "compiled_with_libtriton_sha256": self.ours, "triton_key": self.key,
                "backend_hash": backend_hash(), "tails": self.tails}  # fmt: skip


def pack_cache(cache_dir: Path, tarball: Path, root: str, meta: dict) -> int:
    """Every kernel in ``cache_dir`` as Triton reads it back (metadata JSON and cubin: what
    TRITON_STORE_BINARY_ONLY keeps), its group index pointing into ``root`` (where it will be
    unpacked: Triton's index holds absolute paths), in ``tarball`` with CENSUS.json (``meta``,
    ``root`` added); returns the number of kernels."""
    files = {}
    for entry in sorted(p for p in cache_dir.iterdir() if p.is_dir()):
        for f in sorted(entry.iterdir()):
            if f.suffix in (".json", ".cubin") and not f.name.startswith("__grp__"):
                files[f"{entry.name}/{f.name}"] = f.read_bytes()
    return _write(tarball, files, root, {**meta, "root": root})


def _write(tarball: Path, files: dict[str, bytes], root: str, meta: dict) -> int:
    """``files`` ("folder/name": bytes) into ``tarball`` with a group index per folder pointing
    into ``root``, and CENSUS.json; returns the number of folders (kernels)."""
    by_dir: dict[str, list[str]] = {}
    for rel in files:
        folder, name = rel.split("/")
        by_dir.setdefault(folder, []).append(name)
    with tarfile.open(tarball, "w:gz") as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for folder, names in sorted(by_dir.items()):
            meta_json = next(n for n in names if n.endswith(".json"))
            index = {"child_paths": {n: f"{root}/{folder}/{n}" for n in sorted(names)}}
            add(f"{folder}/__grp__{meta_json}", json.dumps(index).encode())
            for n in sorted(names):
                add(f"{folder}/{n}", files[f"{folder}/{n}"])
        add("CENSUS.json", json.dumps({**meta, "kernels": len(by_dir)}, indent=1).encode())
    return len(by_dir)


def _what_differs(made: dict, key: str, here_sha: str, backend: str) -> str:
    """Why the kernels cannot be re-keyed for this Triton ("" when they can)."""
    import triton

    if triton.__version__ != made["triton"]:
        return f"Triton {triton.__version__}, not {made['triton']}"
    if key.replace(here_sha, made["libtriton_sha256"]) != made["triton_key"]:
        ours, theirs = key.split("-"), made["triton_key"].split("-")
        n = sum(a != b for a, b in zip(ours, theirs, strict=False)) - 1  # less libtriton's
        return f"Triton's Python sources: {max(n, 1)} of its hashed files differ from the census's"
    if backend != made["backend_hash"]:
        return f"ptxas {_short(backend)} here, {_short(made['backend_hash'])} in the census's"
    return ""


def _short(backend: str) -> str:
    """A backend hash's ptxas version as a person reads it (the hash holds its whole banner)."""
    found = re.search(r"V\d+\.\d+\.\d+", backend)
    return found[0] if found else backend.splitlines()[0][:40]


def unpack(tarball: Path, root: Path, rekey: bool = True) -> str:
    """Unpack the census cache into ``root`` as `ImageKey` filed it, re-keyed, or not at all (the
    module docstring); returns the line device_session.sh puts in summary.txt."""
    import triton
    import triton.runtime.cache as cache

    with tarfile.open(tarball) as tar:
        made = json.load(tar.extractfile("./CENSUS.json"))  # type: ignore[arg-type]
        files = {
            m.name.removeprefix("./"): tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isfile() and m.name.count("/") == 2 and "/__grp__" not in m.name
        }
    head = (f"sm90 census cache: {made['kernels']} kernels made for Triton {made['triton']}, "
            f"libtriton sha256 {made['libtriton_sha256'][:16]}")  # fmt: skip
    if str(root) != made["root"]:  # Triton's index holds absolute paths
        return (
            f"sm90 census cache: not used (packed for {made['root']}, TRITON_CACHE_DIR is {root})"
        )
    here_sha, key = libtriton_sha256(), cache.triton_key()
    here = f"this image: Triton {triton.__version__}, libtriton sha256 {here_sha[:16]}"
    why = _what_differs(made, key, here_sha, backend_hash())
    if not why and key == made["triton_key"]:
        _extract(tarball, root)
        return f"{head}; {here} (the same: expect hits)"
    if why or not rekey:
        why = why or "re-keying is off (JETRL_CENSUS_REKEY=0)"
        return f"{head}; {here} (differs: {why}; not unpacked: expect every kernel compiled here)"
    renamed = {}
    for rel, data in files.items():
        folder, name = rel.split("/")
        new = dir_name(key + made["tails"][folder])
        if name.endswith(".json"):  # the metadata names the key's sha256 it was filed under
            m = json.loads(data)
            m["hash"] = hashlib.sha256((key + made["tails"][folder]).encode()).hexdigest()
            data = json.dumps(m).encode()
        renamed[f"{new}/{name}"] = data
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / ".census-rekeyed.tar.gz"
    n = _write(tmp, renamed, str(root), {**made, "triton_key": key, "libtriton_sha256": here_sha})
    _extract(tmp, root)
    tmp.unlink()
    return (f"{head}; {here} (re-keyed: another build of Triton {made['triton']}, the same Python "
            f"sources and ptxas; {n} kernels filed under this image's key: expect hits)")  # fmt: skip


def _extract(tarball: Path, root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(root, filter="data")


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "unpack":
        print("usage: census_cache.py unpack TARBALL ROOT", file=sys.stderr)
        return 2
    try:
        line = unpack(
            Path(argv[1]), Path(argv[2]), os.environ.get("JETRL_CENSUS_REKEY", "1") != "0"
        )
    except Exception as exc:  # a line in summary.txt, never a stopped call
        line = f"sm90 census cache: not used ({type(exc).__name__}: {exc})"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
