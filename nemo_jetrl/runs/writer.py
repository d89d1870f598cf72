"""Writing a run directory in NeMo-RL's layout (`RunWriter`); `logs` reads it back."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_jetrl._optional import require
from nemo_jetrl.runs.logs import CONFIG_FILE
from nemo_jetrl.runs.tensorboard import RUN_ID_TAG, TB_SUBDIR
from nemo_jetrl.runs.train_data import train_data_files

#: where a resumed run puts the killed run's train data of the steps it redoes.
SUPERSEDED_DIR = "superseded"

#: config.yaml may hold a secret given as a literal override: owner read/write only.
CONFIG_MODE = 0o600


class RunWriter:
    """Write a run directory in NeMo-RL's layout (TensorBoard scalars, train_data jsonl, config).

    ``run_dir/tensorboard/events.out.tfevents.*`` via torch's SummaryWriter (the writer NeMo-RL
    uses), ``run_dir/train_data_step{N}.jsonl``, ``run_dir/config.yaml``. Use as a context
    manager or call `close`.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        config: Mapping[str, Any] | str | None = None,
        recipe: str | None = None,
        run_id: str | None = None,
        purge_step: int | None = None,
    ) -> None:
        """Create ``run_dir`` and the TensorBoard writer; write ``config`` if given (a mapping,
        or its YAML text as `config.load.config_yaml` wrote it).

        ``recipe`` (a preset name such as "jetrl") is stored as ``jetrl.recipe`` in config.yaml
        when the config does not already say, so `jetrl compare` labels the run with it.
        ``run_id`` ends the events file's name (``...{RUN_ID_TAG}<id>``) so a reader can tell
        the runs in one directory apart (`nemo_jetrl.runs.tensorboard.event_file_run_id`).
        ``purge_step`` (a resumed run: its first step) starts the events file with TensorBoard's
        restart marker, so readers drop what an earlier file logged at that step or later (the
        steps a killed run logged after its last checkpoint, which the resumed run redoes); the
        killed run's ``train_data_step{N}.jsonl`` of those steps move to ``superseded/`` (a
        reader would otherwise recompute the purged steps from them until the resumed run
        rewrites each).
        """
        tb = require("torch.utils.tensorboard", feature="writing TensorBoard logs")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _after_earlier_event_files(self.run_dir / TB_SUBDIR)
        self.superseded = [] if purge_step is None else _supersede(self.run_dir, purge_step)
        """The train data files moved aside for ``purge_step`` (their new paths)."""
        self._tb = tb.SummaryWriter(
            log_dir=str(self.run_dir / TB_SUBDIR),
            purge_step=purge_step,
            filename_suffix=f"{RUN_ID_TAG}{run_id}" if run_id else "",
        )
        self._closed = False
        if config is not None or recipe is not None:
            self.write_config(config or {}, recipe=recipe)

    def log_scalars(self, step: int, scalars: Mapping[str, Any], prefix: str = "") -> None:
        """Log each finite-or-not numeric value as tag ``prefix/name`` (NeMo-RL's naming).

        Tags already complete (e.g. from `mismatch_metrics`) go with ``prefix=""``. Values that
        are not scalars (lists, dicts, strings) are skipped, as NeMo-RL's TensorBoard logger does.
        """
        if self._closed:
            raise RuntimeError(f"RunWriter for {self.run_dir} is closed")
        for name, value in scalars.items():
            tag = f"{prefix}/{name}" if prefix else str(name)
            v = _scalar(value)
            if v is not None:
                self._tb.add_scalar(tag, v, int(step))

    def log_train_data(self, step: int, records: Sequence[Mapping[str, Any]]) -> Path:
        """Write ``train_data_step{step}.jsonl``: one line per sample, NeMo-RL's shape.

        Each record holds one sample's fields, e.g. ``generation_logprobs``, ``prev_logprobs``,
        ``token_loss_mask`` (lists over the full sequence, logprob t for token t, position 0
        unused), ``sample_loss_mask``, ``rewards``, ``token_ids``, ``advantages``, ``content``.
        Like NeMo-RL, every field is written as a batch of one (``[value]``) plus ``"idx"``.
        """
        path = self.run_dir / f"train_data_step{int(step)}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for i, rec in enumerate(records):
                line = {k: [_plain(v)] for k, v in rec.items() if k != "idx"}
                line["idx"] = i
                f.write(json.dumps(line, default=str) + "\n")
        tmp.replace(path)  # a reader never sees half a file
        return path

    def write_config(self, config: Mapping[str, Any] | str, *, recipe: str | None = None) -> Path:
        """Write ``config.yaml`` (with ``jetrl.recipe`` set from ``recipe`` when absent).

        Interpolations are written as given, not resolved, so ``${oc.env:WANDB_API_KEY}``
        stays that text and a secret's value never reaches the file. A literal secret can still
        come in as an override, so the file is owner-only (``CONFIG_MODE``, 0600), written
        atomically."""
        from nemo_jetrl.config.load import config_yaml  # the one YAML writer of a config

        text = config if isinstance(config, str) else config_yaml(config, recipe=recipe)
        path = self.run_dir / CONFIG_FILE
        tmp = path.with_name(f".{CONFIG_FILE}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, CONFIG_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, CONFIG_MODE)  # also when the file existed with a wider mode
        tmp.replace(path)
        return path

    def flush(self) -> None:
        if not self._closed:
            self._tb.flush()

    def close(self) -> None:
        if not self._closed:
            self._tb.close()
            self._closed = True

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _after_earlier_event_files(tb_dir: Path) -> None:
    """Wait (under ~1 s, only when needed) until the clock's second is past every events file's
    in ``tb_dir``. Readers take a directory's files in name order, and a name starts with its
    creation second (then host, pid): a run resumed within the second its killed run started
    could sort first, and its restart marker would purge nothing
    (tests/runs/test_faults_run_dirs.py)."""
    newest = -1
    for f in tb_dir.glob("events.out.tfevents.*"):
        stamp = f.name.split(".")[3]
        if stamp.isdigit():
            newest = max(newest, int(stamp))
    while int(time.time()) <= newest:
        time.sleep(0.02)


def _supersede(run_dir: Path, first: int) -> list[Path]:
    """Move ``train_data_step{N}.jsonl`` with N >= ``first`` to ``superseded/from_step{first}_
    <time>/`` (kept, out of the readers' way); returns the moved files' new paths."""
    stale = [p for step, p in train_data_files(run_dir).items() if step >= first]
    if not stale:
        return []
    dst = run_dir / SUPERSEDED_DIR / f"from_step{first}_{time.strftime('%Y%m%d-%H%M%S')}"
    dst.mkdir(parents=True, exist_ok=True)
    moved = []
    for p in stale:
        os.replace(p, dst / p.name)
        moved.append(dst / p.name)
    return moved


def _scalar(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    if item is not None:
        try:
            n = numel() if callable(numel) else numel
            if n in (None, 1):
                return float(item())
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def _plain(v: Any) -> Any:
    """Tensors/arrays to lists, numpy/torch scalars to Python numbers."""
    tolist = getattr(v, "tolist", None)
    if callable(tolist):
        return tolist()
    return v
