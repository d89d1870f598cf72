"""`jetrl selfcheck`: run the FP8 quantizer on the golden vectors and report bit-exactness.

For every golden input it quantizes with ``nemo_jetrl.fp8`` and compares, bit for bit:

* against Transformer Engine's reference (``te.*``: 1x128, 128x1 and 128x128, both scale modes);
* against vLLM 0.32 with UE8M0 scales (``vllm.*.ue8m0``), where TE and vLLM agree except in
  groups below vLLM's floors (amax < 1/512 on the group path, < 1e-4 on the block path) and on
  all-zero blocks' scales (TE stores 1.0): those are counted separately as expected;
* and it measures TE-FP32 vs vLLM-FP32 (the off-policy gap of FP32 scales), and checks that our
  emulation of vLLM's own quantizers (``nemo_jetrl.fp8.vllm_native``) reproduces ``vllm.*``.

Exit status 0 only when every TE case is bit-exact, the UE8M0 agreement holds outside the
expected exceptions and the vLLM emulation is bit-exact; 1 otherwise; 2 for user errors,
damaged golden files among them (`_selfcheck_golden.read_golden` validates every tensor the
checks read before any quantization, so damaged data is never reported as a FAIL).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from nemo_jetrl.commands._selfcheck_golden import TE_FILE, VLLM_FILE, read_golden, vllm_block

NAME = "selfcheck"
HELP = "quantize the golden vectors and check bit-exactness against TE and vLLM"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--golden",
        metavar="DIR",
        type=Path,
        default=None,
        help="directory with the golden vectors (default: $JETRL_GOLDEN_DIR, else "
        "the repository's tests/data/golden, else ../shared/golden)",
    )


def _default_golden_dirs() -> list[Path]:
    repo = Path(__file__).resolve().parents[2]
    dirs = [Path(os.environ["JETRL_GOLDEN_DIR"])] if os.environ.get("JETRL_GOLDEN_DIR") else []
    return [
        *dirs,
        repo / "tests" / "data" / "golden",  # the copy a clone of the repository carries
        Path.cwd().parent / "shared" / "golden",
        repo.parent / "shared" / "golden",
    ]


def find_golden_dir(explicit: Path | None) -> Path:
    from nemo_jetrl.errors import UserError

    candidates = [explicit] if explicit is not None else _default_golden_dirs()
    for d in candidates:
        if (d / TE_FILE).is_file() and (d / VLLM_FILE).is_file():
            return d
    tried = ", ".join(str(d) for d in candidates)
    raise UserError(
        f"golden vectors ({TE_FILE}, {VLLM_FILE}) not found in: {tried}. "
        "Pass --golden DIR (or set JETRL_GOLDEN_DIR) pointing at shared/golden."
    )


def _block_amax(x, block):
    import torch.nn.functional as F

    bm, bk = block
    m, k = x.shape
    mb, kb = -(-m // bm), -(-k // bk)
    xp = F.pad(x.float().abs(), (0, kb * bk - k, 0, mb * bm - m))
    return xp.reshape(mb, bm, kb, bk).amax(dim=(1, 3))


def _expand(mask, block, shape):
    bm, bk = block
    return mask.repeat_interleave(bm, 0).repeat_interleave(bk, 1)[: shape[0], : shape[1]]


def _te_rows(te: dict, te_cases: dict) -> list[dict]:
    """Our quantizer against TE's reference: every FP8 byte and every scale_inv bit."""
    import torch

    from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise

    rows = []
    for case, meta in te_cases.items():
        x = te[f"input.{meta['input']}"]
        block = tuple(meta["block"])
        q = quantize_blockwise(x, block, pow2_scales=meta["pow2"], eps=meta["eps"])
        data, sinv = fp8_bits(q.data), q.scale_inv
        if block == (128, 1):
            data, sinv = data.t(), sinv.t()
        wq, ws = te[f"{case}.q"], te[f"{case}.scale_inv"]
        shape_ok = data.shape == wq.shape and sinv.shape == ws.shape
        rows.append(
            {
                "case": case,
                "values": wq.numel(),
                "bits_differ": int((data != wq).sum()) if shape_ok else wq.numel(),
                "scales_differ": int((sinv.view(torch.int32) != ws.view(torch.int32)).sum())
                if shape_ok
                else ws.numel(),
            }
        )
    return rows


def _vllm_rows(te: dict, vl: dict, vl_cases: dict, out: dict) -> None:
    """vLLM's formulas (native emulation) and ours against vLLM's own outputs; appends to
    ``out["vllm_native"]``, ``out["vllm_ue8m0"]`` (pow2 cases: equal outside floored blocks) and
    ``out["te_vs_vllm_fp32"]`` (FP32-scale cases: where the two formulas differ)."""
    from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise
    from nemo_jetrl.fp8.vllm_native import per_block_cast_native, quantize_group_native

    for case, meta in vl_cases.items():
        x, ue8m0 = te[f"input.{meta['input']}"], meta["ue8m0"]
        block = vllm_block(meta["source"])  # read_golden checked it names one
        group = block == (1, 128)
        wq, ws = vl[f"{case}.q"], vl[f"{case}.scale"]
        native = (quantize_group_native if group else per_block_cast_native)(x, ue8m0=ue8m0)
        out["vllm_native"].append(
            {
                "case": case,
                "bits_differ": int((fp8_bits(native.data) != wq).sum()),
                "scales_differ": int((native.scale_inv != ws).sum()),
            }
        )
        ours = quantize_blockwise(x, block, pow2_scales=ue8m0)
        bits, scales = fp8_bits(ours.data) != wq, ours.scale_inv != ws
        row = {"case": case, "values": wq.numel(), "bits_differ": int(bits.sum())}
        if not ue8m0:
            row["dequantized_differ"] = int((ours.dequantize() != native.dequantize()).sum())
            out["te_vs_vllm_fp32"].append(row)
            continue
        floored = _block_amax(x, block) < (1.0 / 512 if group else 1e-4)
        elem = _expand(floored, block, x.shape)
        row |= {
            "bits_differ_outside_floored": int(bits[~elem].sum()),
            "scales_differ": int(scales.sum()),
            "scales_differ_outside_floored": int(scales[~floored].sum()),
            "floored_blocks": int(floored.sum()),
        }
        out["vllm_ue8m0"].append(row)


def run_checks(golden: Path) -> dict:
    """All comparisons; returns a JSON-able dict with per-case counts and an ``ok`` flag."""
    te, vl, te_cases, vl_cases = read_golden(golden)
    out: dict = {"te": _te_rows(te, te_cases), "vllm_ue8m0": [], "te_vs_vllm_fp32": []}
    out["vllm_native"] = []
    _vllm_rows(te, vl, vl_cases, out)
    out["te_ok"] = all(r["bits_differ"] == 0 and r["scales_differ"] == 0 for r in out["te"])
    out["vllm_ue8m0_ok"] = all(
        r["bits_differ_outside_floored"] == 0 and r["scales_differ_outside_floored"] == 0
        for r in out["vllm_ue8m0"]
    )
    out["vllm_native_ok"] = all(
        r["bits_differ"] == 0 and r["scales_differ"] == 0 for r in out["vllm_native"]
    )
    out["ok"] = out["te_ok"] and out["vllm_ue8m0_ok"] and out["vllm_native_ok"]
    return out


def _table(title: str, rows: list[dict], cols: list[str]) -> str:
    head = ["case", *cols]
    cells = [[str(r[c]) for c in head] for r in rows]
    widths = [max([len(h), *(len(c[i]) for c in cells)]) for i, h in enumerate(head)]

    def fmt(vals: list[str]) -> str:
        pairs = enumerate(zip(vals, widths, strict=True))
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in pairs)

    return "\n".join([title, fmt(head), *(fmt(c) for c in cells)])


def run(args: argparse.Namespace) -> int:
    golden = find_golden_dir(args.golden)
    res = run_checks(golden)
    print(f"golden vectors: {golden}\n")
    print(_table("ours vs Transformer Engine reference (must be 0)", res["te"],
                 ["values", "bits_differ", "scales_differ"]))  # fmt: skip
    print()
    print(_table(
        "ours (pow2) vs vLLM UE8M0 (differences allowed only in floored blocks)",
        res["vllm_ue8m0"],
        ["values", "floored_blocks", "bits_differ", "bits_differ_outside_floored",
         "scales_differ", "scales_differ_outside_floored"],
    ))  # fmt: skip
    print()
    print(_table("measured: TE FP32 scales vs vLLM FP32 scales (the off-policy gap)",
                 res["te_vs_vllm_fp32"], ["values", "bits_differ", "dequantized_differ"]))  # fmt: skip
    print()
    print(_table("nemo_jetrl.fp8.vllm_native emulation vs vLLM 0.32 (must be 0)",
                 res["vllm_native"], ["bits_differ", "scales_differ"]))  # fmt: skip
    print()
    verdict = {True: "OK", False: "FAIL"}
    print(
        f"TE bit-exact: {verdict[res['te_ok']]}; vLLM UE8M0 agreement: "
        f"{verdict[res['vllm_ue8m0_ok']]}; vLLM emulation: {verdict[res['vllm_native_ok']]}"
    )
    return 0 if res["ok"] else 1
