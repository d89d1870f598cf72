"""Shared helpers of the GPU benchmarks: CUDA check, CUDA-event timing, table printing.

The benchmark scripts import this as ``_common`` (their own directory is on ``sys.path`` when run
as ``python benchmarks/gpu/<script>.py``).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence

import torch


def require_cuda(script: str) -> None:
    """Exit with a clear message (status 2) when no CUDA GPU is visible."""
    if not torch.cuda.is_available():
        print(
            f"{script}: needs a CUDA GPU (H100/H200 for the numbers in README.md); none is "
            "visible here (torch.cuda.is_available() is False). Run it in the Docker image on a "
            "GPU node.",
            file=sys.stderr,
        )
        raise SystemExit(2)


def cuda_time_ms(fn: Callable[[], object], *, iters: int = 20, warmup: int = 5) -> float:
    """Median wall time of ``fn()`` in milliseconds, measured with CUDA events per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def print_table(rows: Sequence[dict], columns: Sequence[str]) -> None:
    """Plain fixed-width table (floats with 3 significant decimals)."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def gpu_name() -> str:
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} (sm_{props.major}{props.minor}), torch {torch.__version__}, CUDA {torch.version.cuda}"
