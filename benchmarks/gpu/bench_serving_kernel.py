"""Does the vLLM serving kernel pay? Our quantizer + planned GEMM vs BF16 ``F.linear``, by M.

For each token count M, the sum over Qwen3-8B's four linears of one decoder layer (qkv, o,
gate_up, down; `bench_fp8_linear.layer_shapes`) of:

* BF16: ``F.linear(x, W)`` (cuBLAS), captured in a CUDA graph;
* FP8 (ours): `nemo_jetrl.vllm_patch.kernel.serving_forward`, exactly what the patched vLLM
  layer runs per call (the 1x128 activation quantizer writing the GEMM's layout, M padded as the
  GEMM needs, the GEMM backend planned for the layer), against weight scales stored at load as
  the kernel stores them (`gemm_layouts.gemm_ready_weight_scales`), captured in a CUDA graph.

Each row prints the ratio BF16 / FP8, the weight bytes each read per second (TB/s: the
decode sizes are bound by them) and the target with MET / NOT MET: >= 1.5x at M = 1, 8, 32, 64
and >= 1.3x at M = 256 and 8192.

Two timings of the same kernels (``--layer``, on by default), each with its ratio and verdict:

* per linear (runs 4-8's protocol; ``speedup``): each linear its own graph, timed after a write
  over a buffer larger than L2. That write leaves L2 full of dirty lines; unless L2 writes them
  back while the GPU idles before the call (the timing cannot tell), the timed kernel pays that
  write-back to HBM as it evicts them, up to an L2's worth of bytes per linear: a cost no decode
  step has (its L2 holds the previous linear's weights, clean), and one that weighs more on the
  side that reads fewer bytes (FP8);
* one layer (``layer_speedup``): the four linears back to back in one CUDA graph, as a decode
  layer runs them, with no flush: their weights are over 3x L2 (`LAYER_COLD_L2`), so every
  replay still reads each linear's weights from HBM (the others evicted them), and L2 holds
  clean weight lines as in serving; a launch can overlap the one before (`SPLIT_PDL`). Graded
  only where the weights are that large (`layer_cold`).

``--backends`` times several GEMM backends in one run against the same BF16 times (``auto``:
what the layer plans; ``triton_splitk``: the split-K kernel).

Usage: python benchmarks/gpu/bench_serving_kernel.py [--tokens 1 8 32 64 256 8192] [--iters 50]
         [--pow2 | --no-pow2] [--backends auto,triton_splitk] [--no-layer] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from functools import partial

import _common
import torch

MODEL = "Qwen/Qwen3-8B-Base"
# Issue 35's serving targets: minimum BF16/FP8 time ratio per M.
TARGETS = {1: 1.5, 8: 1.5, 32: 1.5, 64: 1.5, 256: 1.3, 8192: 1.3}
LAYER_COLD_L2 = 3
"""The layer timing is graded only where the FP8 weights are at least this many times the GPU's
L2 (`layer_cold`): Qwen3-8B's four linears hold 184 MB of FP8 weights, over 3x an H200's L2."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TARGETS))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--pow2", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument(
        "--backends",
        default="auto",
        help="comma-separated GEMM backends to time; triton_splitk:SPLIT:FUSED[:STAGES[:VARIANT]] "
        "(SPLIT and FUSED each 0, 1 or a(uto); VARIANT tma, pf, pdl, pf+pdl or wg2) forces the "
        "split-K kernel's launch mode, fused quantization, K-loop pipeline depth and TMA, "
        "L2-prefetched or programmatic-dependent weight loads or two-warpgroup decode programs "
        "at every M; 'split-sweep': the variants in SPLIT_SWEEP",
    )
    ap.add_argument(
        "--layer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the four linears back to back in one CUDA graph, as a decode layer runs "
        "them (the layer_* columns)",
    )
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: the CPU test
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    return ap


def verdict(m: int, speedup: float) -> str:
    """``MET`` / ``NOT MET (target >= T x)`` for M's target, ``-`` where the issue sets none."""
    target = TARGETS.get(m)
    if target is None:
        return "-"
    return "MET" if speedup >= target else f"NOT MET (target >= {target}x)"


def serving_fns(x: torch.Tensor, weights: list[torch.Tensor], pow2: bool, backend: str = "auto"):
    """(BF16 fn, FP8 fn, backend): each fn runs the linears on ``x`` as served on ``backend``."""
    import torch.nn.functional as F

    from nemo_jetrl.fp8 import gemm_backends, gemm_layouts, quantize_blockwise
    from nemo_jetrl.vllm_patch import kernel

    ops = kernel.ensure_ops()
    plan = gemm_backends.plan_gemm(
        x.device, out_dtype=torch.bfloat16, pow2_scales=pow2, backend=backend
    )
    layers = []
    for w in weights:
        qw = quantize_blockwise(w, (128, 128), pow2_scales=pow2)
        scale = gemm_layouts.gemm_ready_weight_scales(plan.backend, qw.scale_inv)
        layers.append((qw.data, scale))

    def bf16():
        return [F.linear(x, w) for w in weights]

    def fp8():
        return [
            kernel.serving_forward(ops, x, wq, ws, plan.backend, torch.bfloat16, (pow2, pow2, 0.0))
            for wq, ws in layers
        ]

    return bf16, fp8, plan.backend


VARIANTS = {
    "tma": {"SPLIT_TMA": True},
    "pf": {"SPLIT_PREFETCH": True},
    "pdl": {"SPLIT_PDL": True},
    "pf+pdl": {"SPLIT_PREFETCH": True, "SPLIT_PDL": True},
    "wg2": {"DECODE_WARPGROUPS": 2},
}
"""The split-K kernel's launch variants by name (the fourth mode), each the `triton_split` knobs
it sets."""
# The split-K kernel's launch variants the GPU call times at the decode sizes (device_session.sh
# part 48): the default, quantization unfused at every M (run 8: fusing cost 10% at 32 tokens
# and 40% at 64, each program quantizing its chunk again; unmeasured at 1 and 8; fused at every
# M, measured there, is left out), a deeper and a shallower K-loop pipeline (run 8: 4 stages
# slower than 3 at M <= 8, faster at 32), the weight through TMA descriptors, the weight chunk
# prefetched into L2 (`triton_split.SPLIT_PREFETCH`), and launched as a programmatic dependent
# launch (`SPLIT_PDL`: its start overlaps the previous kernel's end, which the layer timing
# shows), alone and after the prefetch, and programs of 128 weight rows at the decode sizes
# (`DECODE_WARPGROUPS`: each token chunk read by half as many programs, for M = 32 and 64, where
# run 8 had split-K at 1.04-1.18x). Speed only: each gives the default's bits.
SPLIT_SWEEP = (
    "triton_splitk",
    "triton_splitk:a:0",
    "triton_splitk:a:a:4",
    "triton_splitk:a:a:2",
    "triton_splitk:a:a:3:tma",
    "triton_splitk:a:a:3:wg2",
    "triton_splitk:a:a:3:pf",  # last at each M: the variants with instructions of their own
    "triton_splitk:a:a:3:pdl",  # (griddepcontrol, the bulk prefetch), never run on a GPU yet
    "triton_splitk:a:a:3:pf+pdl",
)


def backend_names(backends: str) -> list[str]:
    """``--backends``'s comma-separated names, ``split-sweep`` expanded to `SPLIT_SWEEP`."""
    return backends.replace("split-sweep", ",".join(SPLIT_SWEEP)).split(",")


@contextlib.contextmanager
def splitk_modes(name: str):
    """``triton_splitk:S:F[:STAGES[:VARIANT]]``: the split-K kernel with split mode S and fused
    quantization F (1: at every M, 0: at none, a: the default thresholds), the K loop's
    pipeline depth (`triton_split.SPLIT_STAGES`) and VARIANT one of `VARIANTS`: the weight
    through TMA descriptors (`triton_split.SPLIT_TMA`), prefetched into L2
    (`triton_split.SPLIT_PREFETCH`), launched as a programmatic dependent launch
    (`triton_split.SPLIT_PDL`), prefetched and dependent, or two warpgroups a decode program
    (`triton_split.DECODE_WARPGROUPS`); set for the block and restored after (the bits do not
    depend on them). Yields the backend name without the modes."""
    backend, *modes = name.split(":")
    if not modes:
        yield backend
        return
    from nemo_jetrl.fp8 import triton_split

    stages = modes[2] if len(modes) >= 3 else None
    variant = VARIANTS.get(modes[3], {}) if len(modes) == 4 else {}
    ok = backend == "triton_splitk" and len(modes) in (2, 3) + ((4,) if variant else ())
    if not (ok and set(modes[:2]) <= {"0", "1", "a"}) or (
        stages is not None and not (stages.isdigit() and 1 <= int(stages) <= 8)
    ):
        raise SystemExit(
            f"--backends: {name!r}: modes are triton_splitk:SPLIT:FUSED[:STAGES[:VARIANT]], "
            f"SPLIT and FUSED each 0, 1 or a, STAGES 1 to 8, VARIANT one of "
            f"{', '.join(VARIANTS)}"
        )
    knobs = {
        "SPLIT_MAX_M",
        "FUSE_MAX_M",
        "SPLIT_STAGES",
        *(k for v in VARIANTS.values() for k in v),
    }
    saved = {k: getattr(triton_split, k) for k in knobs}
    big = {"1": 1 << 30, "0": 0}
    triton_split.SPLIT_MAX_M = big.get(modes[0], saved["SPLIT_MAX_M"])
    triton_split.FUSE_MAX_M = big.get(modes[1], saved["FUSE_MAX_M"])
    triton_split.SPLIT_STAGES = int(stages) if stages else saved["SPLIT_STAGES"]
    for knob, value in variant.items():
        setattr(triton_split, knob, value)
    try:
        yield backend
    finally:
        for k, v in saved.items():
            setattr(triton_split, k, v)


def layer_fn(fns: list, name: str):  # type: ignore[no-untyped-def]
    """The linears' fns run in order, as one decode layer runs them (one CUDA graph when timed)."""

    def run_all() -> list:
        return [f() for f in fns]

    run_all.__name__ = name
    return run_all


def layer_cold(weight_bytes: int, device: str) -> bool:
    """Whether a replay of the layer reads its weights from HBM without a flush: the FP8 weights
    (the smaller side) at least `LAYER_COLD_L2` times the GPU's L2, so each linear's weights
    were evicted by the others' since the last replay (unknown L2: not claimed)."""
    l2 = _common.l2_bytes(device)
    return l2 is not None and weight_bytes >= LAYER_COLD_L2 * l2


def run(args: argparse.Namespace) -> list[dict]:
    from bench_fp8_linear import layer_shapes

    shapes = layer_shapes(args.model)
    dev = args.device
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _, n, k in shapes]
    weight_bytes = sum(n * k for _, n, k in shapes)  # FP8: one byte per weight (BF16: two)
    bench = partial(_common.bench_ms, iters=args.iters, graph=True)
    # the layer: no flush (the weights are cold by construction, `layer_cold`), L2 left clean
    layer = partial(_common.bench_ms, iters=args.iters, graph=True, flush_l2=False)
    graded = args.layer and layer_cold(weight_bytes, dev)
    rows = []
    for m in args.tokens:
        xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _, _, k in shapes]
        pairs = list(zip(xs, weights, strict=True))
        bf16_fns = [serving_fns(x, [w], args.pow2)[0] for x, w in pairs]
        bf16_ms = sum(bench(f) for f in bf16_fns)
        bf16_layer_ms = layer(layer_fn(bf16_fns, "bf16_layer")) if args.layer else math.nan
        for name in backend_names(args.backends):
            fp8_ms, backend, fp8_fns = 0.0, "", []
            row = {"M": m, "backend": name, "bf16_ms": bf16_ms,
                   "bf16_TBps": 2 * weight_bytes / bf16_ms / 1e9}  # fmt: skip
            try:
                with splitk_modes(name) as plain:
                    for x, w in pairs:
                        _, fp8, backend = serving_fns(x, [w], args.pow2, plain)
                        fp8_ms += bench(fp8)
                        fp8_fns.append(fp8)
                    fp8_layer_ms = layer(layer_fn(fp8_fns, "fp8_layer")) if args.layer else math.nan
            except Exception as exc:  # a variant that fails costs its own row, not the sweep's
                why = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
                row |= {"fp8_ms": math.nan, "speedup": math.nan, "fp8_TBps": math.nan,
                        "target": f"FAILED ({why})"}  # fmt: skip
            else:
                row["backend"] = backend + name[len(plain) :]
                speedup = bf16_ms / fp8_ms
                row |= {"fp8_ms": fp8_ms, "speedup": speedup,
                        "fp8_TBps": weight_bytes / fp8_ms / 1e9, "target": verdict(m, speedup)}  # fmt: skip
                if args.layer:
                    layer_speedup = bf16_layer_ms / fp8_layer_ms
                    row |= {"layer_bf16_ms": bf16_layer_ms, "layer_fp8_ms": fp8_layer_ms,
                            "layer_speedup": layer_speedup,
                            "layer_fp8_TBps": weight_bytes / fp8_layer_ms / 1e9,
                            "layer_target": verdict(m, layer_speedup) if graded else "-"}  # fmt: skip
            rows.append(row)
            # each row as it is measured: a step that runs out of time keeps what it timed
            line = f"# M={m} {row['backend']}: {row['speedup']:.3f}x BF16, {row['target']}"
            if "layer_speedup" in row:
                line += f"; one layer: {row['layer_speedup']:.3f}x, {row['layer_target']}"
            print(line, flush=True)
    return rows


COLUMNS = ("M", "backend", "bf16_ms", "fp8_ms", "speedup", "bf16_TBps", "fp8_TBps", "target",
           "layer_bf16_ms", "layer_fp8_ms", "layer_speedup", "layer_fp8_TBps", "layer_target")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _common.require_cuda("bench_serving_kernel.py")
    rows = run(args)
    l2 = _common.l2_bytes(args.device)
    print(
        f"# {_common.gpu_name()}, {args.model}: sum of 4 linears per M, each its own CUDA "
        f"graph after an L2 flush; layer_*: the 4 in one graph, no flush (L2 "
        f"{'unknown' if l2 is None else f'{l2 / 2**20:.0f} MiB'}); "
        f"{'pow2' if args.pow2 else 'fp32'} scales"
    )
    _common.print_table(rows, COLUMNS)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
