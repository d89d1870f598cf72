"""Reading TensorBoard event files of a run directory: `find_event_files`, `read_event_file`
(one file, with TFRecord-framing checks so a truncated or corrupt file keeps what came before the
damage, plus NeMo-RL's ``add_hparams`` record) and `read_scalars` (all files merged per tag into
`Series`; for a step logged twice the later wall time wins). `nemo_jetrl.runs.logs.read_run`
combines this with the run's config and train_data jsonl.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_jetrl._optional import require

#: NeMo-RL writes TensorBoard events to <log_dir>/tensorboard.
TB_SUBDIR = "tensorboard"
EVENTS_GLOB = "events.out.tfevents*"
#: `RunWriter` ends each events file name with this and the run id.
RUN_ID_TAG = ".jetrl-run-"


def event_file_run_id(path: str | Path) -> str | None:
    """The run id a `RunWriter` put in an events file's name (None: another writer)."""
    name = Path(path).name
    return name.rsplit(RUN_ID_TAG, 1)[1] or None if RUN_ID_TAG in name else None


@dataclass(frozen=True)
class Series:
    """One scalar tag over steps (sorted by step)."""

    tag: str
    """The TensorBoard tag (e.g. ``train/token_mult_prob_error``)."""

    steps: tuple[int, ...]
    """Steps with a value, ascending."""

    values: tuple[float, ...]
    """The value at each step."""

    source: str = "tensorboard"
    """Where the values came from: "tensorboard", "jsonl" (recomputed) or "tensorboard+jsonl"
    (gaps filled)."""

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def on_step_axis(self) -> bool:
        return on_step_axis(self.tag)


#: Tag prefixes whose TensorBoard "step" is not the training step: NeMo-RL's GPU monitor
#: (``logger.monitor_gpus``, on in our base configs) logs ``ray/*`` at step = whole seconds
#: since the launch (``RayGpuMonitorLogger``, metric_prefix "ray"). Never read as a run's steps.
OFF_STEP_AXIS = ("ray/",)


def on_step_axis(tag: str) -> bool:
    """Whether ``tag``'s steps are training steps (`OFF_STEP_AXIS`: they are not)."""
    return not tag.startswith(OFF_STEP_AXIS)


def find_event_files(run_dir: str | Path) -> list[Path]:
    """Every TensorBoard events file under ``run_dir`` (any depth), sorted by path."""
    return sorted(p for p in Path(run_dir).rglob(EVENTS_GLOB) if p.is_file())


def _tfrecord_intact_bytes(path: Path) -> tuple[int, int, int]:
    """(records, bytes covered by whole records, file size) from the TFRecord framing.

    A record is: uint64 length, uint32 crc, ``length`` bytes, uint32 crc. A file whose records do
    not tile it exactly is truncated (or corrupt); the loader silently stops there, so we check.
    """
    size = path.stat().st_size
    pos = n = 0
    with path.open("rb") as f:
        while pos + 12 <= size:
            f.seek(pos)
            (length,) = struct.unpack("<Q", f.read(8))
            end = pos + 12 + length + 4
            if end > size:
                break
            pos, n = end, n + 1
    return n, pos, size


def read_event_file(
    path: str | Path,
    *,
    hparams_out: dict[str, Any] | None = None,
    restarts_out: list[int] | None = None,
) -> tuple[dict[str, dict[int, tuple[float, float]]], list[str]]:
    """Scalars of one events file: {tag: {step: (wall_time, value)}}, and warnings.

    Uses TensorBoard's own event reader. A truncated or corrupt file yields the records before
    the damage plus a warning naming the file and the byte offset. With ``hparams_out``, the
    ``add_hparams`` record (NeMo-RL's flattened config) is added to it; with ``restarts_out``,
    the step of each restart marker (``SessionLog.START``, a resumed run's ``purge_step``).
    """
    loader_mod = require(
        "tensorboard.backend.event_processing.event_file_loader", feature="reading TensorBoard logs"
    )
    tensor_util = require("tensorboard.util.tensor_util", feature="reading TensorBoard logs")
    path = Path(path)
    out: dict[str, dict[int, tuple[float, float]]] = {}
    msgs: list[str] = []
    n_events = 0
    try:
        for ev in loader_mod.LegacyEventFileLoader(str(path)).Load():
            n_events += 1
            start = ev.HasField("session_log") and ev.session_log.status == ev.session_log.START
            if restarts_out is not None and start:
                restarts_out.append(int(ev.step))
            if not ev.HasField("summary"):
                continue
            for v in ev.summary.value:
                if hparams_out is not None and v.metadata.plugin_data.plugin_name == "hparams":
                    _collect_hparams(v.metadata.plugin_data.content, hparams_out)
                    continue
                val = _scalar_value(v, tensor_util)
                if val is None:
                    continue
                out.setdefault(v.tag, {})
                prev = out[v.tag].get(int(ev.step))
                if prev is None or ev.wall_time >= prev[0]:
                    out[v.tag][int(ev.step)] = (float(ev.wall_time), val)
    except Exception as exc:  # the reader itself failing is a damaged file, not our crash
        msgs.append(
            f"{path}: reading stopped after {n_events} events ({type(exc).__name__}: {exc}); "
            "kept what was read before"
        )
        return out, msgs
    damage = _damage_warning(path, n_events)
    if damage is not None:
        msgs.append(damage)
    return out, msgs


def _scalar_value(v: Any, tensor_util: Any) -> float | None:
    """The float of one summary value: a ``simple_value`` or a one-element numeric tensor;
    None for anything else (text, histograms, images, an undecodable tensor)."""
    kind = v.WhichOneof("value")
    if kind == "simple_value":
        return float(v.simple_value)
    if kind != "tensor":
        return None
    try:
        arr = tensor_util.make_ndarray(v.tensor)
    except Exception:
        return None
    if arr.size != 1 or arr.dtype.kind not in "fiub":
        return None  # text, histograms, images: not scalars
    return float(arr.reshape(()))


def _damage_warning(path: Path, n_events: int) -> str | None:
    """A warning when the file's TFRecord framing does not tile it to its end or counts other
    than the ``n_events`` the reader returned (truncated / corrupt), or cannot be checked;
    None when the file is whole."""
    try:
        recs, good, size = _tfrecord_intact_bytes(path)
    except OSError as exc:
        return f"{path}: could not check the file ({exc})"
    if good != size or recs != n_events:
        return (
            f"{path}: truncated or corrupt events file: {n_events} events read, the rest "
            f"({size - good if good != size else 'some'} bytes of {size}) is unreadable; "
            "kept the scalars read before the damage"
        )
    return None


def read_scalars(
    run_dir: str | Path, *, hparams_out: dict[str, Any] | None = None
) -> tuple[dict[str, Series], list[str]]:
    """All scalars of all events files under ``run_dir``, merged per tag, and warnings.

    Files are read oldest first (names start with the creation time); a file that starts with
    a restart marker at step S drops what older files logged at step S or later, as
    TensorBoard does."""
    merged: dict[str, dict[int, tuple[float, float]]] = {}
    msgs: list[str] = []
    for f in sorted(find_event_files(run_dir), key=lambda p: (p.name, str(p))):
        restarts: list[int] = []
        scal, w = read_event_file(f, hparams_out=hparams_out, restarts_out=restarts)
        msgs.extend(w)
        if restarts:
            for pts in merged.values():
                for step in [s for s in pts if s >= min(restarts)]:
                    del pts[step]
        for tag, pts in scal.items():
            dst = merged.setdefault(tag, {})
            for step, (wall, val) in pts.items():
                if step not in dst or wall >= dst[step][0]:
                    dst[step] = (wall, val)
    series = {
        tag: Series(tag, tuple(sorted(pts)), tuple(pts[s][1] for s in sorted(pts)))
        for tag, pts in merged.items()
        if pts
    }
    return series, msgs


def _collect_hparams(content: bytes, out: dict[str, Any]) -> None:
    pb = require("tensorboard.plugins.hparams.plugin_data_pb2", feature="reading TensorBoard logs")
    try:
        data = pb.HParamsPluginData.FromString(content)
    except Exception:
        return
    if data.HasField("session_start_info"):
        for key, val in data.session_start_info.hparams.items():
            kind = val.WhichOneof("kind")
            if kind is not None:
                out[key] = getattr(val, kind)
