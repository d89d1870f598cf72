"""Checkpoints: fp32 master weights (safetensors), a small state file and a manifest, each one
verified before it is kept.

Layout: ``<checkpoint_dir>/step_{N}/model.safetensors`` (master weights, trainer names),
``state.pt`` (step, optimizer state, RNG states of the data and sampling generators, KV scales,
counters, run id) and ``manifest.json`` (each file's size and sha256, the tensor count).

Saving refuses (`CheckpointError`) when any tensor, master or optimizer state, is not finite:
a non-finite checkpoint is never written. The files are written into a hidden
``.step_{N}.tmp-<pid>`` directory and fsynced; the manifest holds the hashes of the bytes
meant, and the files are read back against it before the directory is renamed into place in
one ``os.replace``. A run killed mid-save leaves only that hidden directory, which
`clean_orphans` removes on the next start. ``keep_top_k`` most recent checkpoints are kept.

`find_resumable` (``--resume``) walks the checkpoints newest first and takes the first whose
files match the manifest, load, and hold finite tensors; each skipped one, an incomplete
``step_N`` (a file removed) included, is reported with the reason.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

_STEP_RE = re.compile(r"^step_(\d+)$")
_ORPHAN_RE = re.compile(r"^\.step_(\d+)\.(tmp|old)-(\d+)$")
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1


class CheckpointError(Exception):
    """A checkpoint that must not be written, or cannot be used."""


def _complete(d: Path) -> bool:
    return (d / MODEL_FILE).is_file() and (d / STATE_FILE).is_file()


def list_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """Every ``step_N`` directory as (step, dir), oldest first, complete or not: a save only
    renames a verified directory into place, so one missing a file was damaged afterwards and
    is named when `find_resumable` skips it (and pruned like any other by ``keep_top_k``)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = _STEP_RE.match(d.name)
        if m and d.is_dir():
            out.append((int(m.group(1)), d))
    return sorted(out)


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The most recent checkpoint directory (unverified), or None."""
    cps = list_checkpoints(ckpt_dir)
    return cps[-1][1] if cps else None


def _tensors(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every floating tensor inside nested dicts/lists (e.g. the optimizer state)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]")


def nonfinite(obj: Any, prefix: str = "") -> list[str]:
    """Names of the floating tensors in ``obj`` holding a NaN or an infinity."""
    return [n for n, t in _tensors(obj, prefix) if not bool(torch.isfinite(t).all())]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_verified(tmp: Path, step: int, master: dict[str, torch.Tensor], state: dict) -> None:
    """Write both files and the manifest into ``tmp``, fsynced, and read them back."""
    from safetensors.torch import save as save_bytes

    blobs = {
        MODEL_FILE: save_bytes({k: v.contiguous() for k, v in master.items()}),
        STATE_FILE: _torch_bytes({"step": step, **state}),
    }
    files = {}
    for name, blob in blobs.items():
        with (tmp / name).open("wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        files[name] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    del blobs
    manifest = {
        "version": MANIFEST_VERSION,
        "step": step,
        "tensors": len(master),
        "run_id": state.get("run_id"),
        "files": files,
    }
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST_FILE)
    problems = _check_files(tmp)[1]  # what reads back from disk is what was meant
    if problems:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"step_{step} failed verification after writing: {problems}")


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    master: dict[str, torch.Tensor],
    state: dict[str, Any],
    *,
    keep_top_k: int | None = None,
) -> Path:
    """Verify, write ``step_{step}`` atomically, prune to the ``keep_top_k`` most recent."""
    bad = nonfinite(master) + nonfinite(state.get("optimizer"), "optimizer")
    if bad:
        raise CheckpointError(
            f"refusing to save step_{step}: {len(bad)} non-finite tensor(s) "
            f"({', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}); earlier checkpoints kept"
        )
    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    _write_verified(tmp, step, master, state)
    if final.exists():  # re-done after a resume from an older checkpoint
        old = root / f".step_{step}.old-{os.getpid()}"
        final.replace(old)
        tmp.replace(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.replace(final)
    _fsync(root)
    if keep_top_k is not None:
        for _, d in list_checkpoints(root)[:-keep_top_k]:
            shutil.rmtree(d, ignore_errors=True)
    return final


def verify_checkpoint(path: str | Path, *, load: bool = True) -> list[str]:
    """Problems with one checkpoint directory ([] = usable): files against the manifest, and
    with ``load`` also that both files load and hold only finite tensors."""
    return _verify(Path(path), load=load)[0]


def _check_files(d: Path) -> tuple[bool, list[str]]:
    """(has a manifest, problems of the files against it)."""
    try:
        files = json.loads((d / MANIFEST_FILE).read_text())["files"]
    except FileNotFoundError:
        files = None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return True, [f"unreadable {MANIFEST_FILE} ({type(exc).__name__}: {exc})"]
    problems: list[str] = []
    for name in (MODEL_FILE, STATE_FILE):
        p = d / name
        if not p.is_file():
            problems.append(f"{name} missing")
        elif files is not None:
            want = files.get(name) or {}
            size = p.stat().st_size
            if size != want.get("size"):
                problems.append(f"{name} is {size} bytes, the manifest says {want.get('size')}")
            elif _sha256(p) != want.get("sha256"):
                problems.append(f"{name} sha256 differs from the manifest")
    return files is not None, problems


def _verify(d: Path, *, load: bool) -> tuple[list[str], Any]:
    """(problems, (master, state) when loaded). Without a manifest (a checkpoint written
    before manifests existed) loading it is the whole check."""
    has_manifest, problems = _check_files(d)
    if not has_manifest and not load:
        problems.append(f"no {MANIFEST_FILE} (written before manifests existed)")
    if problems or not load:
        return problems, None
    try:
        loaded = _load(d)
    except Exception as exc:  # a torn file fails inside safetensors/torch with their own types
        return [f"does not load ({type(exc).__name__}: {str(exc)[:200]})"], None
    bad = nonfinite(loaded[0]) + nonfinite(loaded[1].get("optimizer"), "optimizer")
    if bad:
        return [f"{len(bad)} non-finite tensor(s), e.g. {bad[0]}"], None
    return [], loaded


def _load(d: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    # map_location: a CUDA run saves its optimizer state on the GPU; any machine resumes it
    # (the optimizer moves the state to its parameters' device when loading)
    state = torch.load(d / STATE_FILE, weights_only=True, map_location="cpu")
    return load_file(str(d / MODEL_FILE)), state


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(master weights, state) of one checkpoint directory, verified (`CheckpointError`)."""
    d = Path(path)
    if not _complete(d):
        raise CheckpointError(f"{d} is not a complete checkpoint ({MODEL_FILE} + {STATE_FILE})")
    problems = _check_files(d)[1]  # an older checkpoint without a manifest loads unchecked
    if problems:
        raise CheckpointError(f"{d}: {'; '.join(problems)}")
    return _load(d)


def find_resumable(
    ckpt_dir: str | Path, *, log: Callable[[str], None] = print
) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest checkpoint that verifies, loaded; None when there is no ``step_N`` directory.

    Every ``step_N`` directory counts, an incomplete one (a file removed) too: each skipped one
    is named with its problems (``state.pt missing``). Raises `CheckpointError` when checkpoints
    exist but none verifies (never a silent fresh start over a damaged run)."""
    skipped = []
    for _step, d in reversed(list_checkpoints(ckpt_dir)):
        problems, loaded = _verify(d, load=True)
        if problems:
            skipped.append(f"{d.name}: {'; '.join(problems)}")
            log(f"--resume: skipping {d}: {'; '.join(problems)}")
            continue
        return d, loaded[0], loaded[1]
    if skipped:
        n = len(skipped)
        raise CheckpointError(
            f"no usable checkpoint in {ckpt_dir}: {'its' if n == 1 else 'all'} {n} "
            f"checkpoint{'s are' if n > 1 else ' is'} damaged ({' | '.join(skipped)}); remove "
            "the damaged ones to start fresh, or point checkpointing.checkpoint_dir elsewhere"
        )
    return None


def clean_orphans(ckpt_dir: str | Path) -> list[str]:
    """Remove what a killed save left (``.step_N.tmp-PID``; ``.step_N.old-PID`` is put back
    when ``step_N`` is missing). Call only while holding the run directory's lock."""
    root = Path(ckpt_dir)
    msgs: list[str] = []
    if not root.is_dir():
        return msgs
    for d in sorted(root.iterdir()):
        m = _ORPHAN_RE.match(d.name)
        if not m or not d.is_dir():
            continue
        final = root / f"step_{m.group(1)}"
        if m.group(2) == "old" and not final.exists():
            d.replace(final)
            msgs.append(f"restored {final} from {d.name} (a save was interrupted)")
        else:
            shutil.rmtree(d, ignore_errors=True)
            msgs.append(f"removed {d} left by an interrupted save (pid {m.group(3)})")
    return msgs
