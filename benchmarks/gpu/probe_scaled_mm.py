"""Which GEMM shapes cuBLASLt's blockwise FP8 (``F.scaled_mm``) takes, as our runner calls it.

The first H100 run (benchmarks/gpu/results/README.md) saw ``CUBLAS_STATUS_NOT_SUPPORTED`` for
per-expert GEMMs of 1, 127 and 129 rows and torch's "divisible by 16" error for K = 300. This
probe runs `gemm_backends._scaled_mm` over a grid of M, N, K and both weight blockings, prints what ran and what was refused, and compares each
result with the float64 product of the dequantized operands. It also records where
`gemm_layouts.shape_problem` would have sent the GEMM to Triton, so a wrong rule shows as a
refused shape it let through (or a shape it diverted that ran).

    python benchmarks/gpu/probe_scaled_mm.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _common
import torch

MS = (1, 2, 4, 15, 16, 37, 64, 127, 128, 129, 300)
NS = (128, 256, 264, 384)
KS = (128, 256, 300, 304, 384)


def probe(m: int, n: int, k: int, wblock: tuple[int, int]) -> dict:
    from nemo_jetrl.fp8 import gemm_backends, gemm_layouts, quantize_blockwise

    g = torch.Generator().manual_seed(m * 7 + n * 3 + k)
    a = quantize_blockwise(torch.randn(m, k, generator=g).cuda(), (1, 128))
    b = quantize_blockwise(torch.randn(n, k, generator=g).cuda(), wblock)
    row = {"M": m, "N": n, "K": k, "b_block": f"{wblock[0]}x{wblock[1]}"}
    row["rule"] = gemm_layouts.shape_problem("scaled_mm", m, n, k) or "ok"
    try:
        out = gemm_backends._scaled_mm(a, b, torch.bfloat16)
        torch.cuda.synchronize()
    except Exception as exc:  # the probe records what cuBLASLt says
        row["ran"], row["error"] = False, f"{type(exc).__name__}: {str(exc)[:120]}"
        return row
    exact = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    mag = a.dequantize(torch.float64).abs() @ b.dequantize(torch.float64).abs().t()
    row["ran"] = True
    row["max_err_over_absprod"] = float(((out.double() - exact).abs() / (mag + 1e-30)).max())
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    _common.require_cuda("probe_scaled_mm.py")
    rows = [probe(m, n, k, wb) for wb in ((128, 128), (1, 128)) for m in MS for n in NS for k in KS]
    wrong = [r for r in rows if (r["rule"] == "ok") != r["ran"]]
    for r in rows:
        if not r["ran"] or r["rule"] != "ok":
            print(r)
    ran = [r for r in rows if r["ran"]]
    print(f"# {_common.gpu_name()}: {len(ran)} of {len(rows)} shapes ran; "
          f"max |err| / (|A||B|) over them {max(r['max_err_over_absprod'] for r in ran):.3g}; "
          f"{len(wrong)} where shape_problem disagrees with cuBLASLt")  # fmt: skip
    for r in wrong:
        print("# rule disagrees:", r)
    if args.json:
        args.json.write_text(json.dumps({"gpu": _common.gpu_name(), "rows": rows}, indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
