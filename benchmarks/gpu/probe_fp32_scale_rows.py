"""Which batch sizes give a token the trainer's bits on cuBLASLt with FP32 (non-pow2) scales?

Found on an H100 (results/h100_run5): with FP32 scales at K = 12288 the serving kernel's row for
a token at M = 1 (padded to 4) differed from the trainer's forward over 8192 tokens, while pow2
scales matched at every M. Hypothesis: cuBLASLt picks a different kernel for small M, and kernels
apply the two block scales in a different order (exact for powers of two, rounded for FP32). This
probe runs `F.scaled_mm` (the trainer's `_scaled_mm`) at M_pad in 4..8192 and prints which M_pad
reproduce the M = 8192 rows bit for bit, per shape and scale mode.

    python benchmarks/gpu/probe_fp32_scale_rows.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch

from nemo_jetrl.fp8 import quantize_blockwise
from nemo_jetrl.fp8.gemm_backends import run_gemm

SHAPES = [(4096, 4096), (6144, 4096), (4096, 12288), (4096, 14336), (24576, 4096)]
PADS = [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    records = []
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
        x = torch.randn(8192, k, device="cuda", generator=g).to(torch.bfloat16)
        x[:, ::97] *= 30  # outlier channels, as the serving-bits test uses
        for pow2 in (True, False):
            qw = quantize_blockwise(w, (128, 128), pow2_scales=pow2)
            full = run_gemm(
                "scaled_mm", quantize_blockwise(x, (1, 128), pow2_scales=pow2), qw, torch.bfloat16
            )
            same = []
            for m in PADS:
                got = run_gemm(
                    "scaled_mm",
                    quantize_blockwise(x[:m], (1, 128), pow2_scales=pow2),
                    qw,
                    torch.bfloat16,
                )
                same.append(bool(torch.equal(got, full[:m])))
            records.append({"n": n, "k": k, "pow2": pow2, "pads": PADS, "equal": same})
            print(
                f"N={n:6d} K={k:6d} {'pow2' if pow2 else 'fp32'}: M_pad equal to M=8192 rows: "
                + " ".join(f"{m}:{'Y' if s else 'n'}" for m, s in zip(PADS, same, strict=True)),
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "records": records,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
