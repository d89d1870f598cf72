"""Where the host time of one FP8 training step and one quantizer call goes (cProfile).

`bench_fp8_linear.py` measured on an H100 (results/h100_run4) 2.4-2.8 ms of host time to enqueue
one `Fp8BlockLinear` fwd+bwd at 8192 tokens (8 device launches) against 0.9-2.4 ms of GPU time:
the small layers are host-bound. This prints the functions that spend it, by own time and by
cumulative time, for the linear step and for `quantize_blockwise_triton` alone.

    python benchmarks/gpu/profile_host.py [--iters 50] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch


def _profile(label: str, fn, iters: int, top: int) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        body = buf.getvalue().splitlines()
        start = next((i for i, line in enumerate(body) if "ncalls" in line), 0)
        print(f"## {label}: {iters} calls, by {key}")
        print("\n".join(body[start : start + top + 1]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    from nemo_jetrl.fp8 import Fp8BlockLinear, Fp8LinearConfig
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

    torch.manual_seed(0)
    layer = Fp8BlockLinear(4096, 4096, bias=False, config=Fp8LinearConfig()).cuda().bfloat16()
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        layer(x).backward(dy)

    _profile("Fp8BlockLinear 4096x4096 fwd+bwd, 8192 tokens", step, args.iters, args.top)
    xq = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    _profile(
        "quantize_blockwise_triton 8192x4096 1x128",
        lambda: quantize_blockwise_triton(xq, (1, 128), check_finite=False),
        args.iters * 4,
        args.top,
    )


if __name__ == "__main__":
    main()
