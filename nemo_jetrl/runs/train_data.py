"""Reading NeMo-RL's per-step training data, ``train_data_step{N}.jsonl``: `train_data_files`
(which steps have one), `read_train_data` (the records, broken lines skipped with a warning),
`train_data_tensors` (records stacked into padded tensors, position 0 masked as NeMo-RL's
``[:, 1:]`` does) and `recompute_step_metrics` (the mismatch metrics and reward of one step,
recomputed from the per-token logprobs). `nemo_jetrl.runs.logs.read_run` uses them to fill gaps.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

TRAIN_DATA_RE = re.compile(r"^train_data_step(\d+)\.jsonl$")
#: jsonl field names (NeMo-RL grpo.py).
GEN_FIELD, PREV_FIELD = "generation_logprobs", "prev_logprobs"
TOKEN_MASK_FIELD, SAMPLE_MASK_FIELD, REWARD_FIELD = "token_loss_mask", "sample_loss_mask", "rewards"


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

    rows = _sequence_rows(records)
    B, T = len(records), max(len(r) for r in rows[GEN_FIELD])
    tm = _padded(rows[TOKEN_MASK_FIELD], (B, T), 0.0)
    tm = torch.nan_to_num(tm, nan=0.0) != 0
    tm[:, :1] = False  # NeMo-RL's [:, 1:]
    return {
        "generation_logprobs": _padded(rows[GEN_FIELD], (B, T), math.nan),
        "prev_logprobs": _padded(rows[PREV_FIELD], (B, T), math.nan),
        "token_mask": tm,
        "sample_mask": _sample_mask(records),
        "rewards": _rewards(records),
    }


def _sequence_rows(records: Sequence[Mapping[str, Any]]) -> dict[str, list[list[float]]]:
    """{field: one list of floats per sample} of the generation / prev logprobs and the token
    mask (None -> NaN); ValueError naming the sample and field that is missing, not a list of
    numbers, or of another length than the sample's other two."""
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
    return rows


def _padded(lists: list[list[float]], shape: tuple[int, int], fill: float) -> torch.Tensor:
    """A float64 tensor of ``shape`` [B, T] holding row b of ``lists`` left-aligned in row b,
    ``fill`` elsewhere."""
    import torch

    t = torch.full(shape, fill, dtype=torch.float64)
    for b, r in enumerate(lists):
        if r:
            t[b, : len(r)] = torch.tensor(r, dtype=torch.float64)
    return t


def _sample_mask(records: Sequence[Mapping[str, Any]]) -> torch.Tensor:
    """Bool [B]: each sample's ``sample_mask`` when the records carry one (a non-number counts
    as kept), else all True."""
    import torch

    sm = torch.ones(len(records), dtype=torch.bool)
    if SAMPLE_MASK_FIELD in records[0]:
        for b, rec in enumerate(records):
            v = _unbatch_scalar(rec.get(SAMPLE_MASK_FIELD, 1))
            sm[b] = bool(v) if isinstance(v, (int, float)) else True
    return sm


def _rewards(records: Sequence[Mapping[str, Any]]) -> torch.Tensor | None:
    """Float64 [B] of the samples' rewards; None when the records carry none or one is not
    a number."""
    import torch

    if REWARD_FIELD not in records[0]:
        return None
    vals = [_unbatch_scalar(rec.get(REWARD_FIELD)) for rec in records]
    if all(isinstance(x, (int, float)) for x in vals):
        return torch.tensor(vals, dtype=torch.float64)
    return None


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
