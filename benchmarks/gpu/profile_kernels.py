"""Where the GPU time goes, kernel by kernel, on the FP8 paths still short of issue 48's targets.

A ratio says a path is slow; this says which kernel is. Each workload runs ``--steps`` times under
torch.profiler (CUDA activities only: device time, not the host's) and prints every kernel, memcpy
and memset with its device time per call (``us``), launches per call and share of the workload's
device time, ours and the BF16 reference the same way:

* ``moe``: Qwen3-30B-A3B's routed experts at 2048 tokens, eager (the prefill row at 1.05-1.10x
  ``torch._grouped_mm`` on the H200, run 7): ours (`bench_moe_layer.ours_fn`) vs BF16;
* ``decode``: Qwen3-8B's gate_up through the serving kernel at M = 1 and 64 on ``triton_splitk``
  and ``scaled_mm`` (1.03-1.39x where 1.5x is the target) vs ``F.linear``;
* ``linear``: ``Fp8BlockLinear`` fwd + bwd of qkv at 8192 tokens (1.18x, 1.3x the target) vs a
  BF16 ``nn.Linear``.

Each workload ends with one line: its device time per call, ours / BF16, and the kernel taking
the largest share. Device time is the sum of the activities' durations (overlap counted twice,
gaps between kernels not at all): a profile, not a timing (the benchmarks time).

    python benchmarks/gpu/profile_kernels.py [--only moe decode linear] [--steps 5] [--top 12]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable, Iterable

import _common
import torch

WORKLOADS = ("moe", "decode", "linear")
NAME_WIDTH = 72  # cuBLAS kernel names are template instantiations hundreds of characters long


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--steps", type=int, default=5, help="profiled calls per workload")
    ap.add_argument("--top", type=int, default=12, help="kernels printed per workload")
    return ap


def kernel_rows(activities: Iterable[tuple[str, float]], steps: int) -> list[dict]:
    """``(name, microseconds)`` device activities of ``steps`` calls, grouped by name: one row
    per kernel with ``us`` and ``launches`` per call and its ``share`` of the device time,
    largest first."""
    total: Counter = Counter()
    count: Counter = Counter()
    for name, us in activities:
        total[name] += us
        count[name] += 1
    whole = sum(total.values()) or 1.0
    rows = [
        {"us": total[n] / steps, "launches": count[n] / steps, "share": total[n] / whole,
         "kernel": n if len(n) <= NAME_WIDTH else n[: NAME_WIDTH - 3] + "..."}
        for n in total
    ]  # fmt: skip
    return sorted(rows, key=lambda r: -r["us"])


def report(label: str, pairs: dict[str, Callable[[], object]], steps: int, top: int) -> str:
    """Print each of ``pairs`` (``ours`` first, ``bf16`` last) profiled; return the summary."""
    sums = {}
    for which, fn in pairs.items():
        rows = kernel_rows(_common.device_events(fn, steps), steps)
        sums[which] = (sum(r["us"] for r in rows), rows[0]["kernel"] if rows else "-")
        print(f"## {label}: {which}, {sums[which][0]:.1f} us of device time per call")
        _common.print_table(rows[:top], ("us", "launches", "share", "kernel"))
    ours, bf16 = sums["ours"], sums["bf16"]
    ratio = bf16[0] / ours[0] if ours[0] else float("nan")
    return (f"profile {label}: ours {ours[0]:.1f} us, bf16 {bf16[0]:.1f} us of device time "
            f"(bf16 / ours {ratio:.2f}); ours' largest: {ours[1]}")  # fmt: skip


def moe_pairs() -> dict[str, Callable[[], object]]:
    from bench_moe_layer import bf16_torch_fn, make_layer, moe_shape, ours_fn, route

    shape = moe_shape("Qwen/Qwen3-30B-A3B")
    layer = make_layer(shape, "cuda", seed=0, pow2=True)
    x = torch.randn(2048, shape.hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = route(x, layer["router"], shape.top_k)
    return {
        "ours": ours_fn(x, layer, weights, ids),
        "bf16": bf16_torch_fn(x, layer, weights, ids)[0],
    }


def decode_pairs(m: int, backend: str) -> dict[str, Callable[[], object]]:
    import torch.nn.functional as F
    from bench_fp8_linear import serve_fn

    n, k = 24576, 4096  # Qwen3-8B gate_up
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return {"ours": serve_fn(x, w, False, backend), "bf16": lambda: F.linear(x, w)}


def linear_pairs() -> dict[str, Callable[[], object]]:
    from bench_fp8_linear import fp8_layer, fwd_bwd

    n, k, m = 6144, 4096, 8192  # Qwen3-8B qkv
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(w)
    return {"ours": fwd_bwd(fp8_layer(w, True), x, dy), "bf16": fwd_bwd(ref, x, dy)}


def workloads(only: Iterable[str]) -> list[tuple[str, Callable[[], dict]]]:
    """(label, builder) per profiled workload, in ``--only``'s order."""
    out: list[tuple[str, Callable[[], dict]]] = []
    for name in only:
        if name == "moe":
            out.append(("moe Qwen3-30B-A3B 2048 tokens eager", moe_pairs))
        elif name == "decode":
            for m in (1, 64):
                for backend in ("triton_splitk", "scaled_mm"):
                    label = f"decode Qwen3-8B gate_up M={m} {backend} (fp32 scales)"
                    out.append((label, lambda m=m, b=backend: decode_pairs(m, b)))
        else:
            out.append(("linear Qwen3-8B qkv fwd+bwd 8192 tokens pow2", linear_pairs))
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _common.require_cuda("profile_kernels.py")
    print(f"# {_common.gpu_name()}: device time per kernel (torch.profiler), {args.steps} calls")
    lines = []
    for label, build in workloads(args.only):
        try:  # one workload failing leaves the others' profiles
            lines.append(report(label, build(), args.steps, args.top))
        except Exception as exc:
            lines.append(f"profile {label}: failed: {exc!r}"[:400])
        print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
