"""Read and write NeMo-RL run directories (TensorBoard scalars + per-step training data).

NeMo-RL's ``Logger`` (nemo_rl/utils/logger.py) writes, under its ``logger.log_dir``:

  tensorboard/events.out.tfevents.*      scalars from ``log_metrics(metrics, step, prefix)``,
                                         tag ``f"{prefix}/{name}"``: ``train/token_mult_prob_error``,
                                         ``train/gen_kl_error``, ``train/reward``,
                                         ``validation/accuracy``, ``timing/train/...``;
                                         ``add_hparams`` adds a timestamped sub-directory.
  train_data_step{N}.jsonl               one line per sample (grpo.py), each field sliced to a
                                         batch of one: ``"generation_logprobs": [[...]]``,
                                         ``"prev_logprobs": [[...]]``, ``"token_loss_mask": [[...]]``,
                                         ``"sample_loss_mask": [1]``, ``"rewards": [r]``,
                                         ``"advantages"``, ``"token_ids"``, ``"input_lengths"``,
                                         ``"content"``, plus ``"idx"``.

`read_run` finds event files anywhere under the run directory, merges their scalars (for a
step logged twice, e.g. after a restart, the later wall time wins) and, where a mismatch metric
or the reward is missing for a step that has a ``train_data_step{N}.jsonl``, recomputes it from
the per-token logprobs with `nemo_jetrl.rl.metrics.mismatch_metrics`. As NeMo-RL's loss does
(``[:, 1:]``), position 0 of each sequence is ignored: logprob t belongs to token t, and token
0 has no logprob.

Nothing here crashes on bad data: a truncated or corrupt events file keeps the records before
the damage, a broken jsonl line is skipped, a missing metric is reported; every such event is a
message in ``RunData.warnings`` (also issued as a `RunDataWarning`).

`RunWriter` writes the same layout (the local backend uses it), plus ``config.yaml`` (the run's
config; ``jetrl.recipe`` in it labels the run in ``jetrl compare``).
"""

from __future__ import annotations

import json
import math
import re
import struct
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_jetrl._optional import require

#: NeMo-RL writes TensorBoard events to <log_dir>/tensorboard.
TB_SUBDIR = "tensorboard"
#: the run's config snapshot (NeMo-RL writes config.yaml beside checkpoints; we keep one here).
CONFIG_FILE = "config.yaml"
TRAIN_DATA_RE = re.compile(r"^train_data_step(\d+)\.jsonl$")
EVENTS_GLOB = "events.out.tfevents*"
#: jsonl field names (NeMo-RL grpo.py).
GEN_FIELD, PREV_FIELD = "generation_logprobs", "prev_logprobs"
TOKEN_MASK_FIELD, SAMPLE_MASK_FIELD, REWARD_FIELD = "token_loss_mask", "sample_loss_mask", "rewards"


class RunDataWarning(UserWarning):
    """Something in a run directory could not be read; the result is partial."""


@dataclass(frozen=True)
class Series:
    """One scalar tag over steps (sorted by step)."""

    tag: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    #: "tensorboard", "jsonl" (recomputed) or "tensorboard+jsonl" (gaps filled).
    source: str = "tensorboard"

    def __len__(self) -> int:
        return len(self.steps)


@dataclass
class RunData:
    """What `read_run` found in one run directory."""

    path: Path
    #: display name: ``jetrl.run_name`` / ``jetrl.recipe`` from config.yaml or the TensorBoard
    #: hparams when present, else the directory name.
    label: str
    scalars: dict[str, Series] = field(default_factory=dict)
    #: the run's config.yaml as a plain dict (None when absent or unreadable).
    config: dict[str, Any] | None = None
    #: steps that have a train_data_step{N}.jsonl file.
    train_data_steps: tuple[int, ...] = ()
    #: NeMo-RL's ``add_hparams`` record (flattened config), {} when absent.
    hparams: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def tags(self) -> list[str]:
        return sorted(self.scalars)

    @property
    def last_step(self) -> int | None:
        steps = [s.steps[-1] for s in self.scalars.values() if s.steps]
        return max(steps) if steps else None


def _warn(sink: list[str], msg: str) -> None:
    sink.append(msg)
    warnings.warn(msg, RunDataWarning, stacklevel=3)


# ----------------------------------------------------------------------------- TensorBoard


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
    path: str | Path, *, hparams_out: dict[str, Any] | None = None
) -> tuple[dict[str, dict[int, tuple[float, float]]], list[str]]:
    """Scalars of one events file: {tag: {step: (wall_time, value)}}, and warnings.

    Uses TensorBoard's own event reader. A truncated or corrupt file yields the records before
    the damage plus a warning naming the file and the byte offset. With ``hparams_out``, the
    ``add_hparams`` record (NeMo-RL's flattened config) is added to it.
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
            if not ev.HasField("summary"):
                continue
            for v in ev.summary.value:
                if hparams_out is not None and v.metadata.plugin_data.plugin_name == "hparams":
                    _collect_hparams(v.metadata.plugin_data.content, hparams_out)
                    continue
                kind = v.WhichOneof("value")
                if kind == "simple_value":
                    val = float(v.simple_value)
                elif kind == "tensor":
                    try:
                        arr = tensor_util.make_ndarray(v.tensor)
                    except Exception:
                        continue
                    if arr.size != 1 or arr.dtype.kind not in "fiub":
                        continue  # text, histograms, images: not scalars
                    val = float(arr.reshape(()))
                else:
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
    try:
        recs, good, size = _tfrecord_intact_bytes(path)
    except OSError as exc:
        msgs.append(f"{path}: could not check the file ({exc})")
        return out, msgs
    if good != size or recs != n_events:
        msgs.append(
            f"{path}: truncated or corrupt events file: {n_events} events read, the rest "
            f"({size - good if good != size else 'some'} bytes of {size}) is unreadable; "
            "kept the scalars read before the damage"
        )
    return out, msgs


def read_scalars(
    run_dir: str | Path, *, hparams_out: dict[str, Any] | None = None
) -> tuple[dict[str, Series], list[str]]:
    """All scalars of all events files under ``run_dir``, merged per tag, and warnings."""
    merged: dict[str, dict[int, tuple[float, float]]] = {}
    msgs: list[str] = []
    for f in find_event_files(run_dir):
        scal, w = read_event_file(f, hparams_out=hparams_out)
        msgs.extend(w)
        for tag, pts in scal.items():
            dst = merged.setdefault(tag, {})
            for step, (wall, val) in pts.items():
                if step not in dst or wall >= dst[step][0]:
                    dst[step] = (wall, val)
    series = {
        tag: Series(tag, tuple(sorted(pts)), tuple(pts[s][1] for s in sorted(pts)))
        for tag, pts in merged.items()
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


# ----------------------------------------------------------------------------- jsonl


def train_data_files(run_dir: str | Path) -> dict[int, Path]:
    """{step: path} of the ``train_data_step{N}.jsonl`` files directly in ``run_dir``."""
    out = {}
    d = Path(run_dir)
    if d.is_dir():
        for p in d.iterdir():
            m = TRAIN_DATA_RE.match(p.name)
            if m and p.is_file():
                out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def read_train_data(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of one jsonl file (broken lines skipped with a warning)."""
    path = Path(path)
    records: list[dict[str, Any]] = []
    msgs: list[str] = []
    bad: list[int] = []
    try:
        with path.open("r", encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    bad.append(lineno)
                    continue
                if isinstance(rec, dict):
                    records.append(rec)
                else:
                    bad.append(lineno)
    except OSError as exc:
        msgs.append(f"{path}: cannot read ({exc})")
    if bad:
        msgs.append(
            f"{path}: skipped {len(bad)} unreadable line(s) (first: line {bad[0]}); the file may "
            "be truncated"
        )
    return records, msgs


def _unbatch_seq(v: Any) -> Any:
    """NeMo-RL writes a per-token field as a batch of one, [[...]]: take the one row."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], list):
        return v[0]
    return v


def _unbatch_scalar(v: Any) -> Any:
    """NeMo-RL writes a per-sample scalar as [x]: take x."""
    if isinstance(v, list) and len(v) == 1:
        return v[0]
    return v


def train_data_tensors(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Stack per-sample records into padded tensors.

    Returns float64 ``generation_logprobs``/``prev_logprobs`` [B, T], bool ``token_mask`` [B, T]
    (0 on padding and on position 0), bool ``sample_mask`` [B], and ``rewards`` [B] (or None).
    Raises ValueError naming the missing or malformed field.
    """
    import torch

    if not records:
        raise ValueError("no samples")
    for key in (GEN_FIELD, PREV_FIELD, TOKEN_MASK_FIELD):
        if key not in records[0]:
            raise ValueError(
                f"field {key!r} is missing (fields present: {sorted(records[0])[:12]})"
            )
    rows: dict[str, list[list[float]]] = {GEN_FIELD: [], PREV_FIELD: [], TOKEN_MASK_FIELD: []}
    for i, rec in enumerate(records):
        for key in rows:
            v = _unbatch_seq(rec.get(key))
            if not isinstance(v, list) or not all(
                isinstance(x, (int, float)) or x is None for x in v
            ):
                raise ValueError(f"sample {i}: field {key!r} is not a list of numbers")
            rows[key].append([math.nan if x is None else float(x) for x in v])
        lens = {len(rows[k][-1]) for k in rows}
        if len(lens) != 1:
            raise ValueError(
                f"sample {i}: generation_logprobs, prev_logprobs and token_loss_mask have "
                f"different lengths {sorted(lens)}"
            )
    T = max(len(r) for r in rows[GEN_FIELD])
    B = len(records)

    def pad(lists: list[list[float]], fill: float) -> torch.Tensor:
        t = torch.full((B, T), fill, dtype=torch.float64)
        for b, r in enumerate(lists):
            if r:
                t[b, : len(r)] = torch.tensor(r, dtype=torch.float64)
        return t

    tm = pad(rows[TOKEN_MASK_FIELD], 0.0)
    tm = torch.nan_to_num(tm, nan=0.0) != 0
    tm[:, :1] = False  # NeMo-RL's [:, 1:]
    sm = torch.ones(B, dtype=torch.bool)
    if SAMPLE_MASK_FIELD in records[0]:
        for b, rec in enumerate(records):
            v = _unbatch_scalar(rec.get(SAMPLE_MASK_FIELD, 1))
            sm[b] = bool(v) if isinstance(v, (int, float)) else True
    rewards = None
    if REWARD_FIELD in records[0]:
        vals = [_unbatch_scalar(rec.get(REWARD_FIELD)) for rec in records]
        if all(isinstance(x, (int, float)) for x in vals):
            rewards = torch.tensor(vals, dtype=torch.float64)
    return {
        "generation_logprobs": pad(rows[GEN_FIELD], math.nan),
        "prev_logprobs": pad(rows[PREV_FIELD], math.nan),
        "token_mask": tm,
        "sample_mask": sm,
        "rewards": rewards,
    }


def recompute_step_metrics(
    records: Sequence[Mapping[str, Any]], *, ratio_bounds: tuple[float, float] | None = None
) -> dict[str, float]:
    """Every `mismatch_metrics` tag, plus ``train/reward`` (mean reward), for one step's samples."""
    from nemo_jetrl.rl.metrics import DEFAULT_RATIO_BOUNDS, mismatch_metrics

    t = train_data_tensors(records)
    out = mismatch_metrics(
        t["generation_logprobs"],
        t["prev_logprobs"],
        t["token_mask"],
        t["sample_mask"],
        ratio_bounds=ratio_bounds or DEFAULT_RATIO_BOUNDS,
    )
    if t["rewards"] is not None:
        out["train/reward"] = float(t["rewards"].mean())
    return out


# ----------------------------------------------------------------------------- run dirs


def read_config(run_dir: str | Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The run's config.yaml as a dict (None if absent), and warnings."""
    p = Path(run_dir) / CONFIG_FILE
    if not p.is_file():
        return None, []
    try:
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(OmegaConf.load(p), resolve=False)
    except Exception as exc:
        return None, [
            f"{p}: unreadable config ({type(exc).__name__}: {exc}); label from the directory name"
        ]
    return (cfg if isinstance(cfg, dict) else None), []


def run_label(
    run_dir: str | Path,
    config: Mapping[str, Any] | None,
    hparams: Mapping[str, Any] | None = None,
) -> str:
    """``jetrl.run_name`` or ``jetrl.recipe`` from the config (then from NeMo-RL's flattened
    hparams), else the directory name."""
    jet = (config or {}).get("jetrl")
    if isinstance(jet, Mapping):
        for key in ("run_name", "recipe"):
            v = jet.get(key)
            if isinstance(v, Mapping):
                v = v.get("name")
            if isinstance(v, str) and v.strip():
                return v.strip()
    for key in ("jetrl.run_name", "jetrl.recipe", "jetrl.recipe.name"):
        v = (hparams or {}).get(key)
        if isinstance(v, str) and v.strip():
            return v.strip()
    return Path(run_dir).resolve().name


def read_run(
    run_dir: str | Path,
    *,
    recompute: str = "missing",
    tags: Iterable[str] | None = None,
    ratio_bounds: tuple[float, float] | None = None,
) -> RunData:
    """Read one NeMo-RL (or `RunWriter`) run directory; never raises on bad content.

    Args:
        run_dir: the run's ``logger.log_dir``.
        recompute: "missing" (fill steps where a recomputable tag is absent from TensorBoard),
            "always" (recompute and prefer jsonl values) or "never".
        tags: the tags the caller needs; with "missing", jsonl files are read only when one of
            these recomputable tags lacks a step (None: any recomputable tag).
        ratio_bounds: bounds for the recomputed importance-ratio statistics.

    Raises:
        FileNotFoundError: ``run_dir`` is not a directory.
    """
    if recompute not in ("missing", "always", "never"):
        raise ValueError(f"recompute must be 'missing', 'always' or 'never', got {recompute!r}")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    msgs: list[str] = []
    config, w = read_config(run_dir)
    for m in w:
        _warn(msgs, m)
    hparams: dict[str, Any] = {}
    series, w = read_scalars(run_dir, hparams_out=hparams)
    for m in w:
        _warn(msgs, m)
    files = train_data_files(run_dir)
    run = RunData(
        path=run_dir,
        label=run_label(run_dir, config, hparams),
        hparams=hparams,
        scalars=series,
        config=config,
        train_data_steps=tuple(files),
        warnings=msgs,
    )
    if not series and not files:
        _warn(msgs, f"{run_dir}: no TensorBoard events and no train_data_step*.jsonl found")
    if recompute == "never" or not files:
        return run

    from nemo_jetrl.rl.metrics import metric_names

    recomputable = [*metric_names(), "train/reward"]
    wanted = recomputable if tags is None else [t for t in tags if t in recomputable]
    if recompute == "missing":
        need = any(
            step not in set(series[t].steps) if t in series else True
            for t in wanted
            for step in files
        )
        if not need:
            return run
    computed: dict[str, dict[int, float]] = {}
    for step, path in files.items():
        records, w = read_train_data(path)
        for m in w:
            _warn(msgs, m)
        if not records:
            continue
        try:
            vals = recompute_step_metrics(records, ratio_bounds=ratio_bounds)
        except (ValueError, TypeError) as exc:
            _warn(msgs, f"{path}: cannot recompute metrics: {exc}")
            continue
        for tag, v in vals.items():
            computed.setdefault(tag, {})[step] = v
    for tag, pts in computed.items():
        old = series.get(tag)
        merged = dict(zip(old.steps, old.values, strict=True)) if old else {}
        if recompute == "always":
            merged.update(pts)
            source = "jsonl" if not old else "tensorboard+jsonl"
        else:
            added = {s: v for s, v in pts.items() if s not in merged}
            if not added:
                continue
            merged.update(added)
            source = "jsonl" if not old else "tensorboard+jsonl"
        steps = tuple(sorted(merged))
        series[tag] = Series(tag, steps, tuple(merged[s] for s in steps), source)
    return run
