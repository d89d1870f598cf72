"""Is our FP8 quantizer nearly free? Triton kernel time vs a device-to-device copy of its input.

Quantization is memory-bound: it reads the input once and writes FP8 data plus scales. The floor
is a plain copy of the input (read + write of the same bytes). For each shape, block, format and
scale mode this prints the kernel time, the copy time, their ratio, and the achieved bandwidth
of both; the fused rowwise 1x128 + columnwise 128x1 kernel (`rowcol_quantize`: one read, two FP8
outputs) on the activation shapes; the software encode (``native_cast=False``) against the
default hardware cast; the torch reference (eager ops) for contrast; and the fused RMSNorm + 1x128
kernel against an unfused torch RMSNorm followed by our 1x128 kernel. All numbers come from one
run.

Issue 35's quantizer targets are printed at the end as MET / NOT MET (bf16 input only):
* 8192x4096: every block shape (1x128, 128x128, 128x1, rowwise+columnwise) moves its bytes at
  >= 80% of a bf16 copy's bandwidth (worst over the formats and scale modes measured);
* 128x4096 (a decode batch), 1x128, in a CUDA graph: <= 1.5x a copy's time (also in a graph).

``--sweep-tiles`` instead times each block shape at 8192x4096 (bf16, E4M3, pow2) under every
candidate tile (rows, cols, warps) and the fused kernel under each warp count, checking each
candidate's bits equal the default's: tiles never change bits, so this only picks the fastest.

Usage: python benchmarks/gpu/bench_quantizer_bandwidth.py [--iters 50] [--quick] [--sweep-tiles]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import _common
import torch

# (label, M, K): decode/prefill activations of 8B models and their weight matrices.
SHAPES = (
    ("act decode 128 tok x 4096", 128, 4096),
    ("act prefill 8192 tok x 4096", 8192, 4096),
    ("act 8192 tok x 14336 (down_proj in)", 8192, 14336),
    ("weight 4096 x 4096 (o_proj)", 4096, 4096),
    ("weight 28672 x 4096 (gate_up)", 28672, 4096),
)
BLOCKS = ((1, 128), (128, 128), (128, 1))
ROWCOL = "rowwise+columnwise"
TARGET_SHAPE = "act prefill 8192 tok x 4096"
DECODE_SHAPE = "act decode 128 tok x 4096"
BAR_BANDWIDTH = 0.80  # of a bf16 copy's bandwidth, every block shape
BAR_DECODE = 1.5  # x a copy's time, CUDA graph


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="E4M3 pow2 only, first 3 shapes")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--sweep-tiles", action="store_true", help="time candidate tiles, 8192x4096")
    return ap


# (TM, TK, num_warps) candidates per quantizer mode (triton_kernels._MODE), and fused-kernel warps.
TILE_CANDIDATES = {
    (1, 128): ((16, 128, 4), (32, 128, 4), (64, 128, 4), (64, 128, 8), (128, 128, 8)),
    (128, 128): ((128, 128, 4), (128, 128, 8)),
    (128, 1): ((128, 32, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8)),
}
ROWCOL_WARPS = (4, 8, 16)


def sweep_tiles(
    args: argparse.Namespace, shape: tuple[int, int] = (8192, 4096), device: str = "cuda"
) -> list[dict]:
    """Time every candidate tile at ``shape``; a candidate whose bits differ is reported."""
    from nemo_jetrl.fp8 import rowcol_quantize as rq
    from nemo_jetrl.fp8 import triton_kernels as tk

    m, k = shape
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    copy_ms = _common.cuda_time_ms(partial(dst.copy_, x), iters=args.iters)
    copy_gbs = 2 * x.numel() * 2 / copy_ms / 1e6
    rows, default_tile, default_warps = [], tk._tile, rq.ROWCOL_WARPS

    def bits(q):
        return torch.cat(
            [q.data.view(torch.uint8).flatten(), q.scale_inv.view(torch.uint8).flatten()]
        )

    try:
        for block, candidates in TILE_CANDIDATES.items():
            tk._tile = default_tile
            want = bits(tk.quantize_blockwise_triton(x, block, check_finite=False))
            for tile in candidates:
                tk._tile = lambda mode, tile=tile: tile
                fn = partial(tk.quantize_blockwise_triton, x, block, check_finite=False)
                same = torch.equal(bits(fn()), want)
                t_ms = _common.cuda_time_ms(fn, iters=args.iters)
                gbs = _bytes_moved(m, k, block, 2) / t_ms / 1e6
                rows.append({"block": f"{block[0]}x{block[1]}", "tile": str(tile), "us": 1e3 * t_ms,
                             "of_copy_bw": gbs / copy_gbs, "bits_equal": same})  # fmt: skip
        tk._tile = default_tile
        want = [bits(q) for q in rq.quantize_rowcol_triton(x, check_finite=False)]
        for warps in ROWCOL_WARPS:
            rq.ROWCOL_WARPS = warps
            fn = partial(rq.quantize_rowcol_triton, x, check_finite=False)
            same = all(torch.equal(bits(q), w) for q, w in zip(fn(), want, strict=True))
            t_ms = _common.cuda_time_ms(fn, iters=args.iters)
            gbs = _rowcol_bytes(m, k, 2) / t_ms / 1e6
            rows.append({"block": ROWCOL, "tile": f"(128, 128, {warps})", "us": 1e3 * t_ms,
                         "of_copy_bw": gbs / copy_gbs, "bits_equal": same})  # fmt: skip
    finally:
        tk._tile, rq.ROWCOL_WARPS = default_tile, default_warps
    return rows


def _bytes_moved(m: int, k: int, block: tuple[int, int], elem: int) -> int:
    bm, bk = block
    return m * k * elem + m * k + (-(-m // bm)) * (-(-k // bk)) * 4


def _rowcol_bytes(m: int, k: int, elem: int) -> int:
    """One read of x, two FP8 copies, both scale arrays."""
    return m * k * elem + 2 * m * k + (m * -(-k // 128) + k * -(-m // 128)) * 4


def _rmsnorm_then_quantize(x: torch.Tensor, w: torch.Tensor) -> None:
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

    y = torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6)
    quantize_blockwise_triton(y, (1, 128), check_finite=False)


def _two_passes(quantize, x: torch.Tensor, kw: dict) -> None:
    """What the fused kernel replaces: a 1x128 pass and a transposed 128x1 pass over x."""
    quantize(x, (1, 128), check_finite=False, **kw)
    quantize(x, (128, 1), transpose=True, check_finite=False, **kw)


def targets(rows: list[dict]) -> list[str]:
    """Issue 35's quantizer targets, one line each, MET / NOT MET (n/a when not measured)."""
    out = []
    for block in ("1x128", "128x128", "128x1", ROWCOL):
        got = [r["of_copy_bw"] for r in rows if r["shape"] == TARGET_SHAPE and r["block"] == block]
        if not got:
            out.append(f"quantizer 8192x4096 {block}: n/a (not measured)")
            continue
        worst = min(got)
        verdict = "MET" if worst >= BAR_BANDWIDTH else "NOT MET"
        out.append(
            f"quantizer 8192x4096 {block}: {100 * worst:.0f}% of a bf16 copy's bandwidth (worst "
            f"of {len(got)}; target >= {100 * BAR_BANDWIDTH:.0f}%): {verdict}"
        )
    got = [r["graph/copy_graph"] for r in rows if "graph/copy_graph" in r]
    if got:
        worst = max(got)
        verdict = "MET" if worst <= BAR_DECODE else "NOT MET"
        out.append(
            f"quantizer 128x4096 1x128 in a CUDA graph: {worst:.2f}x a copy's time (worst of "
            f"{len(got)}; target <= {BAR_DECODE}x): {verdict}"
        )
    else:
        out.append("quantizer 128x4096 1x128 in a CUDA graph: n/a (not measured)")
    return out


def run(args: argparse.Namespace) -> list[dict]:
    from nemo_jetrl.fp8 import quantize_blockwise
    from nemo_jetrl.fp8.rowcol_quantize import quantize_rowcol_triton
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton, rmsnorm_quantize_1x128

    dtype = getattr(torch, args.dtype)
    elem = torch.finfo(dtype).bits // 8
    shapes = SHAPES[:3] if args.quick else SHAPES
    modes = (
        [("e4m3", True)]
        if args.quick
        else [(f, p) for f in ("e4m3", "e5m2") for p in (True, False)]
    )
    rows = []
    for label, m, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        dst = torch.empty_like(x)
        copy_ms = _common.cuda_time_ms(partial(dst.copy_, x), iters=args.iters)
        copy_graph_ms = _common.bench_ms(partial(dst.copy_, x), iters=args.iters, graph=True)
        copy_gbs = 2 * x.numel() * elem / copy_ms / 1e6
        for block in BLOCKS:
            if label.startswith("weight") and block == (128, 1):
                continue
            for fmt, pow2 in modes:
                kw = {"fmt": fmt, "pow2_scales": pow2}

                tri = partial(quantize_blockwise_triton, x, block, check_finite=False, **kw)
                soft = partial(tri, native_cast=False)
                tri_checked = partial(quantize_blockwise_triton, x, block, **kw)
                ref = partial(quantize_blockwise, x, block, backend="torch", **kw)
                t_ms = _common.cuda_time_ms(tri, iters=args.iters)
                gbs = _bytes_moved(m, k, block, elem) / t_ms / 1e6
                rows.append(
                    {
                        "shape": label,
                        "block": f"{block[0]}x{block[1]}",
                        "fmt": fmt,
                        "scales": "pow2" if pow2 else "fp32",
                        "triton_us": 1e3 * t_ms,
                        "copy_us": 1e3 * copy_ms,
                        "triton/copy": t_ms / copy_ms,
                        "triton_GB/s": gbs,
                        "copy_GB/s": copy_gbs,
                        "of_copy_bw": gbs / copy_gbs,
                        "soft/native": _common.cuda_time_ms(soft, iters=args.iters) / t_ms,
                        "checked_us": 1e3 * _common.cuda_time_ms(tri_checked, iters=args.iters),
                        "torch_ref/triton": _common.cuda_time_ms(ref, iters=max(5, args.iters // 5))
                        / t_ms,
                    }
                )
                if label == DECODE_SHAPE and block == (1, 128):
                    g_ms = _common.bench_ms(tri, iters=args.iters, graph=True)
                    rows[-1]["graph/copy_graph"] = g_ms / copy_graph_ms
            if label.startswith("act") and block == (1, 128):  # x and dy: both layouts, one read
                for fmt, pow2 in modes:
                    kw = {"fmt": fmt, "pow2_scales": pow2}
                    rc = partial(quantize_rowcol_triton, x, check_finite=False, **kw)
                    r_ms = _common.cuda_time_ms(rc, iters=args.iters)
                    gbs = _rowcol_bytes(m, k, elem) / r_ms / 1e6
                    two = partial(_two_passes, quantize_blockwise_triton, x, kw)
                    rows.append(
                        {
                            "shape": label,
                            "block": ROWCOL,
                            "fmt": fmt,
                            "scales": "pow2" if pow2 else "fp32",
                            "triton_us": 1e3 * r_ms,
                            "copy_us": 1e3 * copy_ms,
                            "triton/copy": r_ms / copy_ms,
                            "triton_GB/s": gbs,
                            "copy_GB/s": copy_gbs,
                            "of_copy_bw": gbs / copy_gbs,
                            "two_passes/fused": _common.cuda_time_ms(two, iters=args.iters) / r_ms,
                        }
                    )
        if dtype in (torch.bfloat16, torch.float16) and label.startswith("act"):
            w = torch.ones(k, device="cuda", dtype=dtype)

            fused = partial(rmsnorm_quantize_1x128, x, w, check_finite=False)
            unfused = partial(_rmsnorm_then_quantize, x, w)
            f_ms = _common.cuda_time_ms(fused, iters=args.iters)
            u_ms = _common.cuda_time_ms(unfused, iters=args.iters)
            rows.append(
                {
                    "shape": label,
                    "block": "rmsnorm+1x128",
                    "fmt": "e4m3",
                    "scales": "pow2",
                    "triton_us": 1e3 * f_ms,
                    "copy_us": 1e3 * copy_ms,
                    "triton/copy": f_ms / copy_ms,
                    # reads x (twice: sum of squares, then normalize), writes y, q and scales
                    "triton_GB/s": (3 * m * k * elem + m * k + m * (-(-k // 128)) * 4) / f_ms / 1e6,
                    "copy_GB/s": copy_gbs,
                    "unfused/fused": u_ms / f_ms,
                }
            )
    return rows


COLUMNS = (
    "shape",
    "block",
    "fmt",
    "scales",
    "triton_us",
    "copy_us",
    "triton/copy",
    "triton_GB/s",
    "copy_GB/s",
    "of_copy_bw",
    "soft/native",
    "graph/copy_graph",
    "two_passes/fused",
    "checked_us",
    "torch_ref/triton",
    "unfused/fused",
)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _common.require_cuda("bench_quantizer_bandwidth")
    print(f"# {_common.gpu_name()}, input {args.dtype}")
    if args.sweep_tiles:
        _common.print_table(sweep_tiles(args), ("block", "tile", "us", "of_copy_bw", "bits_equal"))
        return 0
    rows = run(args)
    _common.print_table(rows, COLUMNS)
    print("# issue 35 quantizer targets" + ("" if args.dtype == "bfloat16" else ": n/a, not bf16"))
    if args.dtype == "bfloat16":
        for line in targets(rows):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
