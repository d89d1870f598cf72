"""Checkpoints: fp32 master weights (safetensors) plus a small state file, written atomically.

Layout: ``<checkpoint_dir>/step_{N}/model.safetensors`` (master weights, trainer names) and
``state.pt`` (step, optimizer state, RNG states of the data and sampling generators, KV scales,
counters). A checkpoint is assembled in a hidden temporary directory and renamed into place in
one ``os.replace``, so a reader (``--resume``) only ever sees complete checkpoints: a run killed
at any moment loses at most the steps since the last save (with ``save_period: 1``, the step in
flight). The ``keep_top_k`` most recent checkpoints are kept.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

_STEP_RE = re.compile(r"^step_(\d+)$")
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"


def _complete(d: Path) -> bool:
    return (d / MODEL_FILE).is_file() and (d / STATE_FILE).is_file()


def list_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, dir), oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = _STEP_RE.match(d.name)
        if m and d.is_dir() and _complete(d):
            out.append((int(m.group(1)), d))
    return sorted(out)


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The most recent complete checkpoint, or None."""
    cps = list_checkpoints(ckpt_dir)
    return cps[-1][1] if cps else None


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    master: dict[str, torch.Tensor],
    state: dict[str, Any],
    *,
    keep_top_k: int | None = None,
) -> Path:
    """Write ``step_{step}`` atomically and prune to the ``keep_top_k`` most recent."""
    from safetensors.torch import save_file

    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in master.items()}, str(tmp / MODEL_FILE))
    torch.save({"step": step, **state}, tmp / STATE_FILE)
    if final.exists():  # re-done after a resume from an older checkpoint
        old = root / f".step_{step}.old-{os.getpid()}"
        final.replace(old)
        tmp.replace(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.replace(final)
    if keep_top_k is not None:
        for _, d in list_checkpoints(root)[:-keep_top_k]:
            shutil.rmtree(d, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(master weights, state) of one checkpoint directory."""
    from safetensors.torch import load_file

    d = Path(path)
    if not _complete(d):
        raise FileNotFoundError(f"{d} is not a complete checkpoint ({MODEL_FILE} + {STATE_FILE})")
    master = load_file(str(d / MODEL_FILE))
    state = torch.load(d / STATE_FILE, weights_only=True)
    return master, state
