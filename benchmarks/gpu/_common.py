"""Shared helpers of the GPU benchmarks: CUDA check, CUDA-event timing (L2 flushed, optional CUDA
graph), host enqueue time and device activity per call, table printing, environment variables set
for a block.

The benchmark scripts import this as ``_common`` (their own directory is on ``sys.path`` when run
as ``python benchmarks/gpu/<script>.py``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

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


@contextlib.contextmanager
def environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """Environment variables set (a value) or unset (None) inside the block, each restored after
    to what it was (its value, or unset), whatever the block raised. The library reads its knobs
    (``JETRL_FP8_*``) when a layer plans, so a benchmark sets them around the first call."""
    saved = {k: os.environ.get(k) for k in values}

    def apply(pairs: Mapping[str, str | None]) -> None:
        for k, v in pairs.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    try:
        apply(values)
        yield
    finally:
        apply(saved)


_L2_FLUSH_BYTES = 256 << 20  # > 2x the L2 of an H100 (50 MB) / H200 (60 MB)


def l2_bytes(device: str | torch.device) -> int | None:
    """The L2 cache size of a CUDA ``device`` in bytes (None elsewhere, or where torch does not
    say)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", None) or None


_LEAD_CYCLES = 500_000  # ~0.3 ms at Hopper's ~1.7 GHz SM clock


def bench_ms(
    fn: Callable[[], object],
    *,
    iters: int = 50,
    warmup: int = 10,
    flush_l2: bool = True,
    graph: bool = False,
) -> float:
    """Median GPU time of one ``fn()`` in milliseconds.

    Each timed call is preceded by a write over a buffer larger than L2 (``flush_l2``: no call
    finds its inputs in cache from the previous one), and that write also keeps the GPU busy
    while the host enqueues ``fn``, so CPU launch latency is not counted for single-kernel calls.
    Events are recorded around every call and read after one final synchronize (no host sync
    between calls). ``graph=True`` captures ``fn`` in a CUDA graph once (after warm-up) and times
    replays: for decode-size work where a multi-kernel ``fn`` would otherwise measure its own
    launch overhead, and the way vLLM runs the serving path.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    call = fn
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # allocations of the capture happen on a side stream first, as torch requires
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        call = g.replay
        for _ in range(3):
            call()
    flush = (
        torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush_l2 else None
    )
    events = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        # ~0.3 ms of queued GPU work before the start event: the host enqueues the whole of fn
        # while it runs, so the events time the GPU's work, not the host's launch latency (an
        # H100 run, results/h100_run4, timed one 3 us quantizer launch at 5-127 us without it).
        # Host time is measured on its own (bench_fp8_linear's host_ms, profile_host.py).
        torch.cuda._sleep(_LEAD_CYCLES)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def device_events(fn: Callable[[], object], steps: int) -> list[tuple[str, float]]:
    """``fn`` run ``steps`` times under the CUDA profiler after one unprofiled call: each device
    activity (kernel, memcpy, memset) as its name and duration in microseconds."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return [
        (e.name, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]


def cuda_time_ms(fn: Callable[[], object], *, iters: int = 50, warmup: int = 10) -> float:
    """`bench_ms` with its defaults (L2 flushed, eager): kept for the scripts' call sites."""
    return bench_ms(fn, iters=iters, warmup=warmup)


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


def host_enqueue_ms(fn: Callable[[], object], *, iters: int = 10) -> float:
    """Median host time (ms) to enqueue one ``fn()`` while the GPU is busy with a sleep kernel
    (enqueueing never waits on the GPU; a host sync inside ``fn`` would show as GPU time)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU work queued ahead of fn
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def device_activity(fn: Callable[[], object], *, steps: int = 3) -> tuple[float, float]:
    """(summed device time in ms, device activities) per ``fn()`` from the CUDA profiler: every
    kernel, memcpy and memset counts as one launch."""
    acts = device_events(fn, steps)
    return sum(us for _, us in acts) / steps / 1e3, len(acts) / steps
