"""``jetrl rehearse --workdir DIR``: refused before any work when it cannot be written or holds an
earlier rehearsal's checkpoint (NeMo-RL's `CheckpointManager` resumes from the newest
``step_N`` there: the second rehearsal would run no step and report "NOT ready")."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

CHECKPOINTS = "checkpoints"  # under the workdir: `run.rehearsal_keys`' checkpointing.checkpoint_dir
_STEP = re.compile(r"step_\d+")  # NeMo-RL's get_latest_checkpoint_path's pattern


def check_workdir(workdir: str | None) -> None:
    """UserError (exit 2) naming ``--workdir`` and what to do; None (a fresh temp dir) passes.
    Creates nothing: the rehearsal makes the directory once every refusal is past."""
    from nemo_jetrl.commands._output import check_output_dir
    from nemo_jetrl.errors import UserError

    if workdir is None:
        return
    work = Path(workdir)
    check_output_dir(work, "--workdir")
    ckpt = work / CHECKPOINTS
    steps = sorted(p.name for p in ckpt.glob("step_*") if _STEP.fullmatch(p.name))
    if steps:
        raise UserError(
            f"--workdir {work} holds an earlier rehearsal (checkpoint {ckpt / steps[-1]}): NeMo-RL "
            "would resume from it and rehearse no step; pass a new --workdir (or none: a fresh "
            f"temporary directory), or remove {ckpt}"
        )


def prepared_in(workdir: str | None, prepare: Callable[[], T]) -> T:
    """``prepare()`` (the launch's config check) with ``--workdir`` checked first: the
    workdir's problem and the config's are named together (exit 2), before any work."""
    from nemo_jetrl.errors import UserError, together

    try:
        check_workdir(workdir)
        flagged: list[str] = []
    except UserError as exc:
        flagged = [str(exc)]
    try:
        prepared = prepare()
    except UserError as exc:
        raise together([*flagged, str(exc)]) from None
    if flagged:
        raise together(flagged)
    return prepared
