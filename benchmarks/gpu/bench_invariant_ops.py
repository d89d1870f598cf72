"""What the batch-invariant ops cost on a GPU: `nemo_jetrl.invariant.ops` on its Triton kernels
vs torch's own (non-invariant) op, and vs the elementwise torch path where that fits in memory,
at Qwen3-0.6B-like sizes (hidden 1024, vocabulary 151936, 16 heads of 128, 2048-token prefill,
64-sequence decode over 1024 keys). Prints one row per op and shape with the ratios; ``--json``
writes them too. Nothing is asserted here (the bits are the `gpu` tests' job,
tests/invariant/test_invariant_kernels_gpu.py).

Usage: python benchmarks/gpu/bench_invariant_ops.py [--iters 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import _common
import torch
import torch.nn.functional as F

from nemo_jetrl.invariant import dispatch, ops

HIDDEN, VOCAB, HEADS, HEAD_DIM = 1024, 151936, 16, 128


def _rms_torch(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _causal(b, tq, tk):
    m = torch.full((tq, tk), torch.finfo(torch.bfloat16).min, device="cuda").triu(tk - tq + 1)
    return m.expand(b, 1, tq, tk)


def _cases():
    bf = torch.bfloat16
    r = lambda *s, dt=bf: torch.randn(*s, device="cuda").to(dt)  # noqa: E731
    w_norm, w_head = r(HIDDEN), r(VOCAB, HIDDEN)
    for rows in (64, 2048):
        x = r(rows, HIDDEN)
        yield (
            "rms_norm",
            f"{rows}x{HIDDEN} bf16",
            (lambda x=x: ops.rms_norm(x, w_norm, 1e-6)),
            (lambda x=x: _rms_torch(x, w_norm)),
            True,
        )
    for rows in (64, 512):
        lg = r(rows, VOCAB, dt=torch.float32) * 5
        yield (
            "log_softmax",
            f"{rows}x{VOCAB} fp32",
            (lambda lg=lg: ops.log_softmax(lg)),
            (lambda lg=lg: torch.log_softmax(lg, -1)),
            True,
        )
    for rows in (64, 2048):
        x = r(rows, HIDDEN)
        yield (
            "lm_head",
            f"{rows}x{HIDDEN} @ {VOCAB}x{HIDDEN} bf16",
            (lambda x=x: ops.linear(x, w_head)),
            (lambda x=x: F.linear(x, w_head)),
            False,
        )
    for b, tq, tk in ((4, 1024, 1024), (64, 1, 1024)):
        q, k, v = (r(b, HEADS, t, HEAD_DIM) for t in (tq, tk, tk))
        mask = _causal(b, tq, tk)
        yield "attention", f"B{b} H{HEADS} q{tq} k{tk} d{HEAD_DIM} bf16", (
            lambda q=q, k=k, v=v, m=mask: ops.attention(q, k, v, m, HEAD_DIM**-0.5)), (
            lambda q=q, k=k, v=v, m=mask: F.scaled_dot_product_attention(q, k, v, m.to(q.dtype))
        ), False  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    _common.require_cuda("bench_invariant_ops")
    rows = []
    for op, shape, inv, own, elementwise in _cases():
        with dispatch.use_kernels("triton"):
            t_k = _common.bench_ms(inv, iters=args.iters, warmup=3)
        t_own = _common.bench_ms(own, iters=args.iters, warmup=3)
        row = {"op": op, "shape": shape, "triton_ms": round(t_k, 4), "torch_ms": round(t_own, 4),
               "triton/torch": round(t_k / t_own, 2)}  # fmt: skip
        if elementwise:  # the torch path: fits in memory for the row ops only
            with dispatch.use_kernels("torch"):
                t_e = _common.bench_ms(inv, iters=max(3, args.iters // 4), warmup=1)
            row.update({"elementwise_ms": round(t_e, 4), "elementwise/triton": round(t_e / t_k, 1)})
        rows.append(row)
        print(row, flush=True)
    cols = ["op", "shape", "triton_ms", "torch_ms", "triton/torch", "elementwise_ms",
            "elementwise/triton"]  # fmt: skip
    _common.print_table(rows, cols)
    if args.json:
        args.json.write_text(json.dumps({"gpu": _common.gpu_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
