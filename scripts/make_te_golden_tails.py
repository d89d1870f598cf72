"""Make the partial-block golden vectors (``te_golden_tails_seed0``) with TE's own reference.

Usage: ``.venv/bin/python scripts/make_te_golden_tails.py TE_SOURCE_DIR OUT_DIR``

``TE_SOURCE_DIR`` is a checkout of NVIDIA/TransformerEngine (the vectors shipped were made at
commit d0067d0, the commit ``te_golden_seed0`` names); its pure-PyTorch blockwise quantizer
reference (``tests/pytorch/references/blockwise_quantizer_reference.py``) runs on CPU and is
imported from there, never copied here. Before writing anything the script re-runs that reference
on the inputs of the existing ``te_golden_seed0.safetensors`` (read from OUT_DIR) and checks it
reproduces their stored bits, so both files come from the same quantizer.

Every input has partial blocks: rows and/or columns that are not multiples of 128, including the
two shapes NeMo-RL's shipped FP8 configs hold (Moonlight ``kv_a_proj_with_mqa`` 576 rows,
Qwen3.5 ``in_proj_a/b`` 32 rows; K cut to keep the file small). The tail blocks carry their own magnitudes (tiny, huge, zero)
so that counting padding, or reading past the tail, changes a scale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SEED = 0
COMMIT = "d0067d0"


def _te_reference(te_dir: Path):
    sys.path.insert(0, str(te_dir / "tests" / "pytorch"))  # TE's tests import `references.*`
    from references.blockwise_quantizer_reference import (  # type: ignore
        BlockwiseQuantizerReference,
    )

    mod = sys.modules[BlockwiseQuantizerReference.__module__]
    assert Path(mod.__file__).resolve().is_relative_to(te_dir.resolve()), mod.__file__
    return BlockwiseQuantizerReference


def _spread(g: torch.Generator, shape: tuple[int, int], lo: float, hi: float) -> torch.Tensor:
    """Normal values times a per-row magnitude 10**U(lo, hi) (fp32)."""
    mag = 10 ** (lo + (hi - lo) * torch.rand(shape[0], 1, generator=g))
    return torch.randn(shape, generator=g) * mag


def make_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    x: dict[str, torch.Tensor] = {}
    # activations: tails along K (1x128) and along M (the colwise 128x1 blocks)
    a = _spread(g, (77, 300), -3, 3)
    a[:, 256:] *= 1e-3  # tail group (44 valid columns) far smaller than its row's full groups
    a[5:9, 256:] = 0.0  # all-zero tail groups
    a[64:, 100] = 3e4  # the colwise tail block (13 valid rows) of column 100 holds the outlier
    a[70, 256:] *= 1e6  # a huge tail group
    x["act_tail"] = a.bfloat16()
    h = _spread(g, (33, 130), -6, 2)
    h[:, 128:] = torch.tensor([[6e-8, -3e-5]]).expand(33, 2)  # 2-column tail near fp16's floor
    x["act_tail_fp16"] = h.half()
    # weights: 128x128 blocks with tails in M, in K, and in both
    x["weight_mla"] = (_spread(g, (576, 512), -2, 0) * 0.05).bfloat16()  # 64-row tail (576xK)
    w = _spread(g, (32, 1024), -1, 1)
    w[:, 896:] = 0.0  # the last block (32 valid rows of 128) all zero
    x["weight_inproj"] = w.bfloat16()
    r = _spread(g, (200, 300), -2, 2)
    r[128:, 256:] *= 1e-30  # the corner block (72x44 valid) is tiny: ~1e-32
    r[128:, :128] *= 1e4  # a huge M-tail block
    r[:128, 256:] = 0.0  # a zero K-tail block
    x["weight_tail2"] = r.bfloat16()
    x["weight_tail_fp32"] = _spread(g, (130, 257), -3, 3)  # 2-row and 1-column tails
    return x


ACTIVATIONS = ("act_tail", "act_tail_fp16")


def run_reference(ref_cls, x: torch.Tensor, block: tuple[int, int], pow2: bool):
    """TE's reference, compact scales: rowwise (and for 1x128 the transposed columnwise)."""
    kw = dict(pow_2_scales=pow2, eps=0.0)
    if block == (1, 128):
        r = ref_cls._quantize_vector_tiling(
            x, torch.float8_e4m3fn, 128, return_transpose=True, **kw
        )
        return r.data, r.scale, r.data_t, r.scale_t
    r = ref_cls._quantize_square_block_tiling(
        x, torch.float8_e4m3fn, 128, return_transpose=False, **kw
    )
    return r.data, r.scale, None, None


def _check_existing(ref_cls, out_dir: Path) -> int:
    """Re-run TE's reference on te_golden_seed0's inputs: same bits as stored, or stop."""
    old = load_file(str(out_dir / "te_golden_seed0.safetensors"))
    meta = json.loads((out_dir / "te_golden_seed0.json").read_text())["cases"]
    n = 0
    for case, m in meta.items():
        if case.endswith(".colwise"):
            continue
        q, s, qt, st = run_reference(
            ref_cls, old[f"input.{m['input']}"], tuple(m["block"]), m["pow2"]
        )
        pairs = [(q, s, case)] + ([(qt, st, case + ".colwise")] if qt is not None else [])
        for q_, s_, c in pairs:
            assert torch.equal(q_.view(torch.uint8), old[f"{c}.q"]), f"{c}: FP8 bits differ"
            assert torch.equal(s_.view(torch.int32), old[f"{c}.scale_inv"].view(torch.int32)), c
            n += 1
    return n


def main(te_dir: Path, out_dir: Path) -> None:
    ref_cls = _te_reference(te_dir)
    n_old = _check_existing(ref_cls, out_dir)
    print(f"TE reference reproduces all {n_old} cases of te_golden_seed0 bit for bit")
    inputs = make_inputs()
    tensors = {f"input.{k}": v.contiguous() for k, v in inputs.items()}
    cases: dict[str, dict] = {}
    for name, x in inputs.items():
        block = (1, 128) if name in ACTIVATIONS else (128, 128)
        for mode, pow2 in (("pow2", True), ("fp32", False)):
            q, s, qt, st = run_reference(ref_cls, x, block, pow2)
            key = f"te.{name}.{mode}"
            tensors[f"{key}.q"] = q.view(torch.uint8).contiguous()
            tensors[f"{key}.scale_inv"] = s.float().contiguous()
            src = "TE reference " + ("_quantize_vector_tiling" if qt is not None else
                                     "_quantize_square_block_tiling")  # fmt: skip
            cases[key] = {"input": name, "block": list(block), "pow2": pow2, "eps": 0.0,
                          "shape": list(x.shape), "source": src + " (rowwise)"}  # fmt: skip
            if qt is not None:
                tensors[f"{key}.colwise.q"] = qt.view(torch.uint8).contiguous()
                tensors[f"{key}.colwise.scale_inv"] = st.float().contiguous()
                cases[f"{key}.colwise"] = {
                    "input": name, "block": [128, 1], "pow2": pow2, "eps": 0.0,
                    "shape": list(x.shape), "source": src + " (return_transpose)",
                    "layout": "transposed [K, M]; scale_inv [K, ceil(M/128)]",
                }  # fmt: skip
    save_file(tensors, str(out_dir / "te_golden_tails_seed0.safetensors"))
    index = {"seed": SEED, "te_commit": COMMIT, "fp8": "e4m3", "cases": cases}
    (out_dir / "te_golden_tails_seed0.json").write_text(json.dumps(index, indent=1) + "\n")
    print(f"wrote {len(cases)} cases, {len(inputs)} inputs to {out_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1])
    main(Path(sys.argv[1]), Path(sys.argv[2]))
