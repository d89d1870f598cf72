"""Fp8BlockLinear fwd+bwd step time relative to a BF16 nn.Linear (CPU emulation).

Run: .venv/bin/python benchmarks/bench_fp8_linear.py [--features 4096] [--tokens 2048] [--reps 3]

One step = forward on [tokens, features] bf16 input plus backward with a random bf16 output
gradient (dX and dW). Both layers hold bf16 weights; further rows use an fp32 master weight and
a plain fp32 nn.Linear (the GEMM precision the CPU emulation actually runs).
On CPU the FP8 layer is an emulation (quantize, dequantize, fp32 GEMM), so a ratio above 1 is
expected; on GPU TE runs real FP8 GEMMs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.linear import Fp8BlockLinear


def _step_time(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, reps: int) -> float:
    def step() -> None:
        layer.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        layer(xi).backward(dy)

    step()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--exact", action="store_true", help="also time exact_gemm=True (slow)")
    args = ap.parse_args()
    f, t = args.features, args.tokens
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, f, generator=g).to(torch.bfloat16)
    dy = torch.randn(t, f, generator=g).to(torch.bfloat16)
    torch.manual_seed(0)
    ref = nn.Linear(f, f, dtype=torch.bfloat16)
    print(f"Linear {f}x{f}, {t} tokens, fwd+bwd, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.reps}")  # fmt: skip
    print(f"{'layer':30} {'s/step':>8} {'vs bf16':>8}", flush=True)
    base = _step_time(ref, x, dy, args.reps)
    print(f"{'nn.Linear bf16':30} {base:8.3f} {1.0:8.2f}", flush=True)
    # fp32 reference: on CPUs without native bf16 GEMMs, bf16 matmul is far slower than fp32,
    # and the FP8 emulation runs fp32 GEMMs; this row separates emulation cost from that effect.
    ref32 = nn.Linear(f, f, dtype=torch.float32)
    s32 = _step_time(ref32, x.float(), dy.float(), args.reps)
    print(f"{'nn.Linear fp32 (x, W fp32)':30} {s32:8.3f} {s32 / base:8.2f}", flush=True)
    layers = [
        ("Fp8BlockLinear pow2, bf16 W", Fp8BlockLinear.from_linear(ref, Fp8LinearConfig())),
        ("Fp8BlockLinear fp32 scales", Fp8BlockLinear.from_linear(ref, Fp8LinearConfig.te_blockwise_fp32_scales())),
        ("Fp8BlockLinear pow2, fp32 W", Fp8BlockLinear(f, f, dtype=torch.float32)),
    ]  # fmt: skip
    if args.exact:
        cfg = Fp8LinearConfig(exact_gemm=True)
        layers.append(("Fp8BlockLinear exact_gemm", Fp8BlockLinear.from_linear(ref, cfg)))
    for label, layer in layers:
        s = _step_time(layer, x, dy, args.reps)
        print(f"{label:30} {s:8.3f} {s / base:8.2f}", flush=True)


if __name__ == "__main__":
    main()
