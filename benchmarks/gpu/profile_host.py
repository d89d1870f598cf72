"""Host time of the training FP8 linear per Qwen3-8B shape, against its GPU time (issue 48, 5).

An H100 run (results/README.md, run 6) read 2.1-2.3 ms of host enqueue per `Fp8BlockLinear`
fwd+bwd at 8192 tokens against 0.88-1.26 ms of GPU work, while cProfile counted 1.15 ms: cProfile
sees the calling thread only, and autograd runs the backward of CUDA tensors on its device
thread. For each of Qwen3-8B's four linears (qkv, o, gate_up, down) at ``--tokens`` this prints:

* ``host_fwd_ms`` / ``host_bwd_ms``: median wall time to enqueue one forward / one backward,
  each behind ~50 ms of queued GPU sleep (the host never waits on the GPU; the forward of the
  timed backward runs before the sleep);
* ``bf16_host_ms``: the control, torch's own BF16 ``nn.Linear`` fwd + bwd at the same shape
  enqueued the same way (what this host's Python, torch and driver cost without FP8);
* ``triton_gemm_host_ms``: the same FP8 layer fwd + bwd with every GEMM on our Triton GEMM
  (``JETRL_FP8_GEMM_BACKEND=triton``: launched directly, no cuBLASLt descriptors or algorithm
  heuristic per call), the experiment that splits cuBLASLt's host cost (``host_ms`` minus it)
  from ours (`--no-triton-gemm` skips it);
* ``gpu_ms`` and ``launches``: summed device time and device activities of one fwd+bwd (CUDA
  profiler, as bench_fp8_linear);
* ``frames_fwd`` / ``frames_bwd``: Python calls per forward / backward on every thread
  (``threading.setprofile_all_threads``, Python >= 3.12; the calling thread only before);
* whether Triton kernels launch through their compiled launcher directly
  (`triton_launch.direct_launch_status`);

then a MET / NOT MET line per shape and one for all four: host fwd+bwd < GPU time. ``--ops N``
prints torch.profiler's top N ops by self CPU time per shape (host time inside torch and the
CUDA runtime, all threads); ``--cprofile`` adds cProfile tables (the calling thread only).

    python benchmarks/gpu/profile_host.py [--tokens 8192] [--iters 10] [--ops 12] [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import threading
import time
from collections import Counter

import _common
import torch
from _fp8_linear_layers import gemm_backend
from bench_fp8_linear import fp8_layer, layer_shapes

MODEL = "Qwen/Qwen3-8B-Base"  # Qwen3-8B's linear shapes (the base and the chat model share them)
TARGET_TOKENS = 8192
_SLEEP_CYCLES = 100_000_000  # ~50 ms of GPU work queued ahead of each timed call


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=TARGET_TOKENS)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ops", type=int, default=12, help="torch.profiler rows per shape (0: none)")
    ap.add_argument("--cprofile", action="store_true", help="add cProfile tables (one shape)")
    ap.add_argument("--pow2", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--triton-gemm", action=argparse.BooleanOptionalAction, default=True,
        help="also time the layer's host with every GEMM on the triton backend",
    )  # fmt: skip
    return ap


def _behind_sleep_ms(prepare, iters: int) -> float:  # type: ignore[no-untyped-def]
    """Median wall time (ms) of the call ``prepare()`` returns, enqueued behind a GPU sleep."""
    times = []
    for _ in range(iters):
        fn = prepare()
        torch.cuda.synchronize()
        torch.cuda._sleep(_SLEEP_CYCLES)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def python_calls(fn) -> tuple[int, bool]:  # type: ignore[no-untyped-def]
    """(Python calls made by ``fn()``, whether every thread was counted)."""
    calls = Counter()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call":
            calls[0] += 1

    every = getattr(threading, "setprofile_all_threads", None)
    (every or sys.setprofile)(profile)
    try:
        fn()  # a backward returns once autograd's device thread ran it (counted there too)
    finally:
        (every or sys.setprofile)(None)
    torch.cuda.synchronize()
    return calls[0], every is not None


def _ops_table(step, rows: int) -> str:  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def _cprofile(label: str, fn, iters: int, top: int = 25) -> None:  # type: ignore[no-untyped-def]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    body = buf.getvalue().splitlines()
    start = next((i for i, line in enumerate(body) if "ncalls" in line), 0)
    print(f"## cProfile (calling thread only) {label}: {iters} calls, by cumulative time")
    print("\n".join(body[start : start + top + 1]), flush=True)


def bf16_control_ms(w: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, iters: int) -> float:
    """The control: torch's own BF16 linear, fwd + bwd enqueued the same way on the same host
    (what this machine's Python, torch and CUDA driver cost for one layer without FP8)."""
    ref = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        ref.weight.copy_(w)
    for _ in range(3):
        ref(x).backward(dy)
    torch.cuda.synchronize()

    def backward():  # type: ignore[no-untyped-def]
        ref.zero_grad(set_to_none=True)
        x.grad = None
        y = ref(x)
        return lambda: y.backward(dy)

    return _behind_sleep_ms(lambda: lambda: ref(x), iters) + _behind_sleep_ms(backward, iters)


def _fp8_calls(w: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, pow2: bool):  # type: ignore[no-untyped-def]
    """(one fwd+bwd step, a forward's preparer, a backward's preparer) of an `Fp8BlockLinear`
    holding ``w``, planned, compiled and its FP8 weight cached by 3 steps."""
    layer = fp8_layer(w, pow2)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(dy)

    for _ in range(3):  # compile, plan, cache the FP8 weight
        step()
    torch.cuda.synchronize()

    def forward():  # type: ignore[no-untyped-def]
        return lambda: layer(x)

    def backward():  # type: ignore[no-untyped-def]
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = layer(x)
        return lambda: y.backward(dy)

    return step, forward, backward


def triton_gemm_host_ms(w: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, args) -> float:  # type: ignore[no-untyped-def]
    """Host fwd + bwd of the same layer planned with every GEMM on the ``triton`` backend."""
    with gemm_backend("triton"):
        _, forward, backward = _fp8_calls(w, x, dy, args.pow2)
        return _behind_sleep_ms(forward, args.iters) + _behind_sleep_ms(backward, args.iters)


def measure(name: str, n: int, k: int, args: argparse.Namespace) -> dict:
    """One shape's row (see the module docstring)."""
    m = args.tokens
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    step, forward, backward = _fp8_calls(w, x, dy, args.pow2)
    host_fwd = _behind_sleep_ms(forward, args.iters)
    host_bwd = _behind_sleep_ms(backward, args.iters)
    bf16_host = bf16_control_ms(w, x, dy, args.iters)
    triton_host = triton_gemm_host_ms(w, x, dy, args) if args.triton_gemm else None
    gpu, launches = _common.device_activity(step)
    frames_fwd, every = python_calls(forward())
    frames_bwd, _ = python_calls(backward())
    if args.ops:
        print(f"## {name} [{m}, {k}] x [{n}, {k}]: torch.profiler, 3 steps, by self CPU time")
        print(_ops_table(step, args.ops), flush=True)
    if args.cprofile and name == "o_proj":
        _cprofile(f"{name} fwd+bwd", step, 20)
    return {
        "layer": name,
        "M": m,
        "N": n,
        "K": k,
        "host_fwd_ms": host_fwd,
        "host_bwd_ms": host_bwd,
        "host_ms": host_fwd + host_bwd,
        "bf16_host_ms": bf16_host,
        "triton_gemm_host_ms": triton_host,
        "gpu_ms": gpu,
        "launches": launches,
        "frames_fwd": frames_fwd,
        "frames_bwd": frames_bwd,
        "all_threads": every,
    }


COLUMNS = ("layer", "M", "N", "K", "host_fwd_ms", "host_bwd_ms", "host_ms", "bf16_host_ms",
           "triton_gemm_host_ms", "gpu_ms", "launches",
           "frames_fwd", "frames_bwd", "all_threads")  # fmt: skip


def target_lines(rows: list[dict]) -> list[str]:
    """Issue 48's host target, one line per shape and one for all four Qwen3-8B linears at
    `TARGET_TOKENS` tokens: MET / NOT MET, or NOT MEASURED (another token count, a shape
    missing)."""
    lead = f"target: Fp8BlockLinear host enqueue (fwd + bwd) < GPU time at {TARGET_TOKENS} tokens"
    want = {name for name, _n, _k in layer_shapes(MODEL)}
    at = [r for r in rows if r["M"] == TARGET_TOKENS]
    lines = []
    for r in at:
        verdict = "MET" if r["host_ms"] < r["gpu_ms"] else "NOT MET"
        control, tri = r.get("bf16_host_ms"), r.get("triton_gemm_host_ms")
        ctl = "" if control is None else f"; torch's BF16 linear on this host {control:.3f} ms"
        ctl += "" if tri is None else f"; on Triton GEMMs (no cuBLASLt call) {tri:.3f} ms"
        lines.append(
            f"{lead}, Qwen3-8B {r['layer']}: {verdict} (host {r['host_ms']:.3f} ms = fwd "
            f"{r['host_fwd_ms']:.3f} + bwd {r['host_bwd_ms']:.3f} vs GPU {r['gpu_ms']:.3f} ms"
            f"{ctl})"
        )
    if {r["layer"] for r in at} != want:
        lines.append(f"{lead}, Qwen3-8B all 4 linears: NOT MEASURED (run --tokens {TARGET_TOKENS})")
    else:
        short = [r["layer"] for r in at if r["host_ms"] >= r["gpu_ms"]]
        verdict = "MET" if not short else f"NOT MET ({', '.join(short)})"
        lines.append(f"{lead}, Qwen3-8B all 4 linears: {verdict}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _common.require_cuda("profile_host")
    from nemo_jetrl.fp8 import triton_launch

    torch.manual_seed(0)
    print(f"# {_common.gpu_name()}; Python {sys.version.split()[0]}")
    rows = [measure(name, n, k, args) for name, n, k in layer_shapes(MODEL)]
    on, why = triton_launch.direct_launch_status()
    print(f"# Triton launches: {'direct (compiled launcher)' if on else 'JITFunction.run'}: {why}")
    _common.print_table(rows, COLUMNS)
    for line in target_lines(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
