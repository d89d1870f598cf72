"""Is our FP8 quantizer nearly free? Triton kernel time vs a device-to-device copy of its input.

Quantization is memory-bound: it reads the input once and writes FP8 data plus scales. The floor
is a plain copy of the input (read + write of the same bytes). For each shape, block, format and
scale mode this prints the kernel time, the copy time, their ratio, and the achieved bandwidth
of both; on the activation shapes the rowwise 1x128 + columnwise 128x1 pair graded on the mode
the training linear runs (``rowcol_mode``: two passes by default, or the fused `rowcol_quantize`
kernel, one read and two FP8 outputs), the fused kernel's share beside it; the software encode
(``native_cast=False``) against the default hardware cast; the torch reference (eager ops) for
contrast; and the fused RMSNorm + 1x128 kernel against an unfused torch RMSNorm followed by our
1x128 kernel. All numbers come from one run.

Issue 35's quantizer targets are printed at the end as MET / NOT MET (bf16 input only):
* 8192x4096: every block shape (1x128, 128x128, 128x1, rowwise+columnwise) moves its bytes at
  >= 80% of a bf16 copy's bandwidth (worst over the formats and scale modes measured);
* 128x4096 (a decode batch), 1x128, in a CUDA graph: <= 1.5x a copy's time (also in a graph).

``--sweep-tiles`` then times each block shape at 8192x4096 (bf16, E4M3, pow2; 128x1 also with the
transposed output the training linear's WGrad operand takes) under every candidate tile (rows,
cols, warps) and the fused kernel under each warp count, checking each candidate's bits equal the
default's: tiles never change bits, so this only picks the fastest. One line per block names the
best tile and the default's share, MET / NOT MET against the same 80% (the GPU call runs it; the
sm_90 census compiles every candidate, so the call's Triton cache holds them).

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
    ap.add_argument(
        "--sweep-tiles", action="store_true", help="then time candidate tiles at 8192x4096"
    )
    return ap


# (TM, TK, num_warps) candidates per quantizer call ((block, transposed output); the mode is
# triton_kernels._MODE[block]), and fused-kernel warps. None spills a register on sm_90 (the
# census compiles them all): 1x128 at (64, 128, 4) spilled 8 bytes and the fused kernel at 4
# warps 992 bytes at 255 registers (ptxas 3.6 for sm_90a), so those two are not candidates.
# 128x1: (TM, TK, warps) hold the 128 x TK tile whole; (..., CHUNK, STAGES) read it CHUNK rows at
# a time, pipelined; (..., 128, 1, True) pack the transposed output four tokens a word before
# the transpose (`triton_kernels._tile`; new since run 8, the trainer's layout only).
_COLUMNWISE = ((128, 32, 4), (128, 64, 4), (128, 64, 4, 32, 2), (128, 128, 8, 32, 2),
               (128, 64, 4, 16, 3))  # fmt: skip
_PACKED = ((128, 64, 4, 128, 1, True), (128, 128, 8, 128, 1, True))
TILE_CANDIDATES = {
    ((1, 128), False): ((16, 128, 4), (32, 128, 4), (64, 128, 8), (128, 128, 8)),
    ((128, 128), False): ((128, 128, 4), (128, 128, 8)),
    ((128, 1), False): _COLUMNWISE,
    ((128, 1), True): _COLUMNWISE + _PACKED,  # WGrad's operand, [K, M] (the two-pass rowcol)
}
# Fused rowcol launches, (warps, chunk, programs_per_sm, stages) (`rowcol_quantize.RowcolTile`);
# registers a thread (ptxas 3.6 for sm_90a): (8, 128) 249 (one program per SM; 36% of a copy on
# the H200, run 7), (16, 128) 128, (8, 32) 122-128, (8, 64) 163, (4, 16) 120.
ROWCOL_TILES = ((8, 128, 0, 1), (16, 128, 0, 1), (8, 32, 0, 2), (8, 32, 0, 3), (8, 64, 0, 2),
                (4, 16, 0, 2), (8, 32, 2, 2))  # fmt: skip
SWEEP_SHAPE = (8192, 4096)


def sweep_tiles(
    args: argparse.Namespace, shape: tuple[int, int] = SWEEP_SHAPE, device: str = "cuda"
) -> list[dict]:
    """Time every candidate tile at ``shape``; a candidate whose bits differ is reported."""
    from nemo_jetrl.fp8 import rowcol_quantize as rq
    from nemo_jetrl.fp8 import triton_kernels as tk

    m, k = shape
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    copy_ms = _common.cuda_time_ms(partial(dst.copy_, x), iters=args.iters)
    copy_gbs = 2 * x.numel() * 2 / copy_ms / 1e6
    rows, default_tile, default_rowcol = [], tk._tile, rq.ROWCOL_TILE

    def bits(q):
        return torch.cat(
            [q.data.view(torch.uint8).flatten(), q.scale_inv.view(torch.uint8).flatten()]
        )

    try:
        for (block, transpose), candidates in TILE_CANDIDATES.items():
            tk._tile = default_tile
            default = default_tile(tk._MODE[block])
            run = partial(tk.quantize_blockwise_triton, x, block, transpose=transpose,
                          check_finite=False)  # fmt: skip
            want = bits(run())
            label = f"{block[0]}x{block[1]}" + (" transposed" if transpose else "")
            for tile in candidates:
                tk._tile = lambda mode, tile=tile: tile
                same = torch.equal(bits(run()), want)
                t_ms = _common.cuda_time_ms(run, iters=args.iters)
                gbs = _bytes_moved(m, k, block, 2) / t_ms / 1e6
                rows.append({"block": label, "tile": str(tile), "us": 1e3 * t_ms,
                             "of_copy_bw": gbs / copy_gbs, "bits_equal": same,
                             "default": tuple(tile) == tuple(default)})  # fmt: skip
        tk._tile = default_tile
        want = [bits(q) for q in rq.quantize_rowcol_triton(x, check_finite=False)]
        for cand in ROWCOL_TILES:
            rq.ROWCOL_TILE = tile = rq.RowcolTile(*cand)
            fn = partial(rq.quantize_rowcol_triton, x, check_finite=False)
            same = all(torch.equal(bits(q), w) for q, w in zip(fn(), want, strict=True))
            t_ms = _common.cuda_time_ms(fn, iters=args.iters)
            gbs = _rowcol_bytes(m, k, 2) / t_ms / 1e6
            rows.append({"block": ROWCOL, "tile": _rowcol_label(tile), "us": 1e3 * t_ms,
                         "of_copy_bw": gbs / copy_gbs, "bits_equal": same,
                         "default": tile == default_rowcol})  # fmt: skip
    finally:
        tk._tile, rq.ROWCOL_TILE = default_tile, default_rowcol
    return rows


def _rowcol_label(t) -> str:  # type: ignore[no-untyped-def]
    return f"(warps {t.warps}, chunk {t.chunk}, programs/SM {t.programs_per_sm}, stages {t.stages})"


def sweep_verdicts(rows: list[dict]) -> list[str]:
    """One line per swept block: the fastest tile and the default's share of a copy's bandwidth,
    MET / NOT MET for the best against `BAR_BANDWIDTH` (a tile whose bits differ: NOT MET)."""
    out = []
    for block in dict.fromkeys(r["block"] for r in rows):
        mine = [r for r in rows if r["block"] == block]
        best = max(mine, key=lambda r: r["of_copy_bw"])
        default = next((r for r in mine if r["default"]), None)
        differ = [r["tile"] for r in mine if not r["bits_equal"]]
        was = (
            f"default {default['tile']}: {100 * default['of_copy_bw']:.0f}%"
            if default
            else "no default"
        )
        verdict = "MET" if best["of_copy_bw"] >= BAR_BANDWIDTH and not differ else "NOT MET"
        bits = f"; bits differ under {differ}" if differ else ""
        out.append(
            f"quantizer tile sweep {SWEEP_SHAPE[0]}x{SWEEP_SHAPE[1]} {block}: best {best['tile']} "
            f"{100 * best['of_copy_bw']:.0f}% of a bf16 copy's bandwidth ({was}{bits}; target "
            f">= {100 * BAR_BANDWIDTH:.0f}%): {verdict}"
        )
    return out


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


def _rowcol_row(label: str, fmt: str, pow2: bool, m: int, k: int, elem: int, fused_ms: float,
                two_ms: float, copy_ms: float, copy_gbs: float) -> dict:  # fmt: skip
    """The rowwise+columnwise row, graded on the mode the training linear runs (`rowcol_mode`:
    ``$JETRL_FP8_ROWCOL`` or the package default, two passes since run 8 measured them faster):
    both outputs' bytes over its time; the fused kernel's share beside it."""
    from _fp8_linear_layers import default_rowcol

    mode = default_rowcol()
    t_ms = two_ms if mode == "two_pass" else fused_ms
    moved = _rowcol_bytes(m, k, elem) / 1e6
    return {
        "shape": label, "block": ROWCOL, "fmt": fmt, "scales": "pow2" if pow2 else "fp32",
        "rowcol_mode": mode, "triton_us": 1e3 * t_ms, "copy_us": 1e3 * copy_ms,
        "triton/copy": t_ms / copy_ms, "triton_GB/s": moved / t_ms, "copy_GB/s": copy_gbs,
        "of_copy_bw": moved / t_ms / copy_gbs, "fused_of_copy_bw": moved / fused_ms / copy_gbs,
        "two_passes/fused": two_ms / fused_ms,
    }  # fmt: skip


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
        modes = sorted(
            {r["rowcol_mode"] for r in rows if r["block"] == block and "rowcol_mode" in r}
        )
        how = f", {' and '.join(modes)} (the training linear's mode)" if modes else ""
        out.append(
            f"quantizer 8192x4096 {block}: {100 * worst:.0f}% of a bf16 copy's bandwidth (worst "
            f"of {len(got)}{how}; target >= {100 * BAR_BANDWIDTH:.0f}%): {verdict}"
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
                    two = partial(_two_passes, quantize_blockwise_triton, x, kw)
                    two_ms = _common.cuda_time_ms(two, iters=args.iters)
                    rows.append(_rowcol_row(label, fmt, pow2, m, k, elem, r_ms, two_ms,
                                            copy_ms, copy_gbs))  # fmt: skip
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
    "rowcol_mode",
    "fused_of_copy_bw",
    "two_passes/fused",
    "checked_us",
    "torch_ref/triton",
    "unfused/fused",
)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _common.require_cuda("bench_quantizer_bandwidth")
    print(f"# {_common.gpu_name()}, input {args.dtype}")
    rows = run(args)
    _common.print_table(rows, COLUMNS)
    print("# issue 35 quantizer targets" + ("" if args.dtype == "bfloat16" else ": n/a, not bf16"))
    if args.dtype == "bfloat16":
        for line in targets(rows):
            print(line)
    if args.sweep_tiles:
        swept = sweep_tiles(args)
        cols = ("block", "tile", "default", "us", "of_copy_bw", "bits_equal")
        _common.print_table(swept, cols)
        for line in sweep_verdicts(swept):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
