"""One run, several directories: join a job resubmitted after its time limit.

NeMo-RL gives every launch a new ``logger.log_dir`` (``get_next_experiment_dir``: ``exp_001``,
``exp_002``... beside each other), while a launch that finds a checkpoint resumes from it. So a
200-step job cut at its time limit after step 120 (last checkpoint at step 100) and resubmitted
leaves ``exp_001`` with steps 1-120 and ``exp_002`` with steps 101-200: one run.

`join_resumed` treats sibling ``exp_NNN`` directories with the same run label (``jetrl.run_name``
or ``jetrl.recipe`` from the logged hyperparameters; a directory labelled only by its own name is
never joined) as one run when the later one starts past the earlier one's first step (it
continued; one that starts over is another run). Steps concatenate; where they overlap, the later
directory wins (the earlier one's steps from the resume point on were redone), as TensorBoard's
own ``purge_step`` does within one directory. Steps are training steps only: NeMo-RL's GPU
monitor logs ``ray/*`` against seconds since each launch (`runs.tensorboard.OFF_STEP_AXIS`), so
those tags never say where a directory starts, and a joined run keeps the last launch's
series of each. ``RunData.joined`` says what was joined and which
steps were replaced; ``jetrl compare`` prints it under the table.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from nemo_jetrl.runs.logs import RunData, Series
from nemo_jetrl.runs.tensorboard import on_step_axis

#: NeMo-RL's experiment directory names (``nemo_rl.utils.logger.get_next_experiment_dir``).
EXP_DIR = re.compile(r"exp_(\d+)")


def first_step(run: RunData) -> int | None:
    """The first step ``run`` logged past step 0 (None: none). Step 0 is what every launch logs
    as it starts, resumed or not (NeMo-RL's ``timing/setup/*``, our engine check's
    ``jetrl/kernel/*``): counted, every directory would start at 0 and none would continue."""
    steps = [min(pos) for s in run.step_series() if (pos := [st for st in s.steps if st > 0])]
    return min(steps) if steps else None


def _exp_number(run: RunData) -> int | None:
    m = EXP_DIR.fullmatch(run.path.resolve().name)
    return int(m.group(1)) if m else None


def _joinable_key(run: RunData) -> tuple[Path, str] | None:
    if _exp_number(run) is None or first_step(run) is None:
        return None
    if run.label == run.path.resolve().name:  # no logged identity: cannot tell whose it is
        return None
    return run.path.resolve().parent, run.label


def _chains(group: list[RunData]) -> list[list[RunData]]:
    """Consecutive experiments that continue one another (by experiment number)."""
    chains: list[list[RunData]] = []
    for run in sorted(group, key=lambda r: _exp_number(r) or 0):
        start = first_step(run)
        if chains and start is not None and start > (first_step(chains[-1][0]) or 0):
            chains[-1].append(run)
        else:
            chains.append([run])
    return chains


def _span(steps: Sequence[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if steps else "none"


def join_chain(chain: Sequence[RunData]) -> RunData:
    """One RunData for a run resumed across ``chain`` (oldest first); later parts win overlaps."""
    if len(chain) == 1:
        return chain[0]
    points: dict[str, dict[int, float]] = {}
    sources: dict[str, set[str]] = {}
    data_steps: set[int] = set()
    notes = []
    for i, part in enumerate(chain):
        cut = first_step(part) if i else None  # this part redid every step from here on
        own = sorted({st for s in part.step_series() for st in s.steps if st > 0})
        if cut is not None:
            for tag, pts in points.items():
                if not on_step_axis(tag):  # seconds since each launch: the last part's series
                    if tag in part.scalars:
                        pts.clear()
                    continue
                for st in [st for st in pts if st >= cut]:
                    del pts[st]
            data_steps = {st for st in data_steps if st < cut}
        note = f"{part.path.name} steps {_span(own)}"
        replaced = [st for st in _all_steps(chain[:i]) if cut is not None and st >= cut]
        if replaced:
            note += f" (steps {_span(replaced)} taken from {part.path.name}, not the earlier logs)"
        notes.append(note)
        for tag, s in part.scalars.items():
            points.setdefault(tag, {}).update(zip(s.steps, s.values, strict=True))
            sources.setdefault(tag, set()).add(s.source)
        data_steps |= set(part.train_data_steps)
    scalars = {}
    for tag, pts in points.items():
        steps = tuple(sorted(pts))
        src = sources[tag]
        source = src.pop() if len(src) == 1 else "tensorboard+jsonl"
        scalars[tag] = Series(tag, steps, tuple(pts[st] for st in steps), source)
    last = chain[-1]
    return replace(
        last,
        path=chain[0].path,
        scalars=scalars,
        train_data_steps=tuple(sorted(data_steps)),
        warnings=[w for part in chain for w in part.warnings],
        run_ids=tuple(dict.fromkeys(i for part in chain for i in part.run_ids)),
        parts=tuple(part.path for part in chain),
        joined=f"{last.label}: one run resumed across {len(chain)} directories of "
        f"{chain[0].path.parent}: " + "; ".join(notes),
    )


def _all_steps(parts: Sequence[RunData]) -> list[int]:
    return sorted({st for part in parts for s in part.step_series() for st in s.steps})


def join_resumed(runs: Sequence[RunData]) -> list[RunData]:
    """``runs`` with each resumed run's directories joined into one (at the position of its
    first directory); every other run unchanged and in its place."""
    groups: dict[tuple[Path, str], list[RunData]] = {}
    for run in runs:
        key = _joinable_key(run)
        if key is not None:
            groups.setdefault(key, []).append(run)
    joined_of: dict[int, RunData] = {}  # id(first part) -> the joined run
    absorbed: set[int] = set()
    for group in groups.values():
        for chain in _chains(group):
            if len(chain) > 1:
                joined_of[id(chain[0])] = join_chain(chain)
                absorbed.update(id(r) for r in chain[1:])
    return [joined_of.get(id(r), r) for r in runs if id(r) not in absorbed]
