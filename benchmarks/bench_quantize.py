"""Quantization throughput on a 4096x4096 bf16 tensor, relative to torch.clone bandwidth.

Run: .venv/bin/python benchmarks/bench_quantize.py [--size 4096] [--reps 5]

Bandwidth counts bytes that must move: the bf16 input read plus the FP8 output and fp32 scales
written; clone moves 2 bytes read + 2 written per element. Both are measured in the same run so
the ratio is comparable across machines (and across load on a shared machine).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from nemo_jetrl.fp8 import quantize_blockwise
from nemo_jetrl.fp8.vllm_native import per_block_cast_native, quantize_group_native


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    n = args.size
    x = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    clone_t = _time(lambda: x.clone(), args.reps)
    clone_bw = 4 * x.numel() / clone_t
    rows = [("torch.clone", "-", clone_t, clone_bw)]
    cases = []
    for block in ((1, 128), (128, 128)):
        for pow2 in (True, False):
            cases.append(
                (f"quantize_blockwise {block[0]}x{block[1]}", "pow2" if pow2 else "fp32", block,
                 lambda b=block, p=pow2: quantize_blockwise(x, b, pow2_scales=p))
            )  # fmt: skip
    for ue8m0 in (True, False):
        mode = "ue8m0" if ue8m0 else "fp32"
        cases.append(("vllm_native group 1x128", mode, (1, 128),
                      lambda u=ue8m0: quantize_group_native(x, ue8m0=u)))  # fmt: skip
        cases.append(("vllm_native block 128x128", mode, (128, 128),
                      lambda u=ue8m0: per_block_cast_native(x, ue8m0=u)))  # fmt: skip
    for label, mode, (bm, bk), fn in cases:
        t = _time(fn, args.reps)
        moved = 2 * x.numel() + x.numel() + 4 * (n // bm) * (n // bk)
        rows.append((label, mode, t, moved / t))
    print(f"{n}x{n} bf16, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.reps}")  # fmt: skip
    print(f"{'op':28} {'scales':6} {'ms':>9} {'GB/s':>8} {'vs clone':>9}")
    for label, mode, t, bw in rows:
        print(f"{label:28} {mode:6} {t * 1e3:9.2f} {bw / 1e9:8.2f} {bw / clone_bw:9.3f}")


if __name__ == "__main__":
    main()
