"""Our TE blockwise-FP8 layout (``to_te`` / ``from_te`` / ``te_fp8_to_hf``) against TE's own code.

The layout facts come from Transformer Engine 2.20.2's Python files (``.venv-te-recipe``, the
meta wheel installed with ``--no-deps --target``): ``Float8BlockQuantizer.get_scale_shape`` /
``get_columnwise_shape`` and ``Float8BlockwiseQTensorStorage.dequantize``, which decodes rowwise
and columnwise data with TE's padded scale layout. They run in a subprocess
(tests/megatron/te_blockwise_probe.py: TE's C extension stood in by its enums only; installed in
this process TE would break ``import megatron.core``, see test_megatron_config.py). A wrong idea
of the layout shared by ``to_te`` and ``from_te`` (scales not transposed, padding on the wrong
dim) round-trips in tests/fp8/test_fp8_layouts.py; here TE's shapes and TE's decoding disagree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_jetrl.fp8 import quantize_blockwise
from nemo_jetrl.fp8.layouts import TeBlockwiseTensor, to_te
from nemo_jetrl.megatron import export as ex

REPO = Path(__file__).resolve().parents[2]
TE_DIR = Path(os.environ.get("JETRL_TE_RECIPE_DIR", REPO / ".venv-te-recipe"))
PROBE = Path(__file__).with_name("te_blockwise_probe.py")
TE_FILE = TE_DIR / "transformer_engine" / "pytorch" / "tensor" / "float8_blockwise_tensor.py"
# Non-multiples of 128 and of 4 on either dim, a single row / column, square block grids (where
# an untransposed scale has the right shape but wrong values).
SHAPES = [(128, 128), (256, 384), (100, 200), (130, 1), (1, 130), (257, 513), (5, 1000), (3, 6)]


def ask_te(requests: list[dict], tmp: Path) -> list:
    """Answers from TE's own code (see te_blockwise_probe.py for the requests)."""
    if not TE_FILE.is_file():
        pytest.fail(
            f"TE's Python files not found under {TE_DIR} (bash scripts/setup_env.sh installs "
            "them; or set JETRL_TE_RECIPE_DIR)"
        )
    src, dst = tmp / "requests.pt", tmp / "answers.pt"
    torch.save(requests, src)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
    env.pop("PYTHONPATH", None)  # TE's files only: the probe never imports nemo_jetrl
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(TE_DIR), str(src), str(dst)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(dst, weights_only=True)


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    """Values whose 128x128, 1x128 and 128x1 block scales all differ from their neighbours'."""
    g = torch.Generator().manual_seed(seed)
    i = torch.arange(m).view(-1, 1)
    j = torch.arange(k).view(1, -1)
    e = (i // 128) * 3 - (j // 128) * 2 + i % 5 - j % 3
    return torch.randn(m, k, generator=g) * torch.pow(2.0, e.float())


def _nan_padding(s: torch.Tensor) -> torch.Tensor:
    """``to_te`` pads with zeros (scale_inv is never 0 here); TE leaves padding uninitialised."""
    return torch.where(s == 0, torch.full_like(s, float("nan")), s)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _layouts(m: int, k: int, fmt: str) -> dict[str, TeBlockwiseTensor]:
    x = _x(m, k, m * 7919 + k)
    q2 = quantize_blockwise(x, (128, 128), fmt=fmt, pow2_scales=False)
    r1 = quantize_blockwise(x, (1, 128), fmt=fmt, pow2_scales=False)
    c1 = quantize_blockwise(x, (128, 1), fmt=fmt, pow2_scales=False)
    return {"2d": (to_te(q2, q2), q2, q2), "1d": (to_te(r1, c1), r1, c1)}


def test_scale_and_data_shapes_are_tes(tmp_path):
    reqs, ours = [], []
    for m, k in SHAPES:
        for dim, (t, _, _) in zip((2, 1), _layouts(m, k, "e4m3").values(), strict=True):
            for cw, s in ((False, t.rowwise_scale_inv), (True, t.columnwise_scale_inv)):
                reqs.append({"op": "scale_shape", "shape": (m, k), "dim": dim, "columnwise": cw})
                ours.append(tuple(s.shape))
            reqs.append({"op": "columnwise_shape", "shape": (m, k)})
            ours.append(tuple(t.columnwise_data.shape))
            assert tuple(t.rowwise_data.shape) == (m, k)
    te = ask_te(reqs, tmp_path)
    bad = [(r, o, a) for r, o, a in zip(reqs, ours, te, strict=True) if o != tuple(a)]
    assert bad == [], bad


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_te_decodes_our_data_and_scales_bit_for_bit(tmp_path, fmt):
    reqs, want = [], []
    for m, k in SHAPES:
        for kind, (t, row, col) in _layouts(m, k, fmt).items():
            common = {"op": "dequantize", "fmt": fmt, "is_2D_scaled": kind == "2d"}
            reqs.append(
                {
                    **common,
                    "rowwise_data": t.rowwise_data,
                    "rowwise_scale_inv": _nan_padding(t.rowwise_scale_inv),
                    "columnwise_data": None,
                    "columnwise_scale_inv": None,
                }
            )
            want.append((f"{kind} rowwise {m}x{k}", row.dequantize(torch.float32)))
            reqs.append(
                {
                    **common,
                    "rowwise_data": None,
                    "rowwise_scale_inv": None,
                    "columnwise_data": t.columnwise_data,
                    "columnwise_scale_inv": _nan_padding(t.columnwise_scale_inv),
                }
            )
            want.append((f"{kind} columnwise {m}x{k}", col.dequantize(torch.float32)))
    te = ask_te(reqs, tmp_path)
    bad = []
    for (what, ref), got in zip(want, te, strict=True):
        if got.shape != ref.shape or not torch.equal(_bits(got), _bits(ref)):
            bad.append(what)
    assert bad == [], f"TE decodes these differently from ours: {bad}"


def _te_laid_out(w: torch.Tensor, te_shape: tuple[int, int]) -> TeBlockwiseTensor:
    """A 128x128 FP8 weight stored as TE stores it: TE's scale shape, NaN in the padding.

    The compact scales go top-left (where TE's 2-D dequantize reads them); the test checks this
    storage against TE's own decoding before handing it to ``te_fp8_to_hf``.
    """
    q = quantize_blockwise(w, (128, 128), fmt="e4m3", pow2_scales=True)
    s = torch.full(te_shape, float("nan"))
    s[: q.scale_inv.shape[0], : q.scale_inv.shape[1]] = q.scale_inv
    return TeBlockwiseTensor(tuple(w.shape), True, q.data.view(torch.uint8), s, None, None)


def test_te_fp8_to_hf_reads_tes_layout(tmp_path):
    # head_dim 128, FFN 384: fused boundaries on 128-row blocks; hidden 330 pads the scales.
    shape = ex.GptShape(1, 2, 1, 128, 384)
    hidden = 330
    pre = "decoder.layers.0."
    weights = {
        pre + "self_attention.linear_qkv.weight": (512, hidden),
        pre + "self_attention.linear_proj.weight": (hidden, 256),
        pre + "mlp.linear_fc1.weight": (768, hidden),
        pre + "mlp.linear_fc2.weight": (hidden, 384),
    }
    names = list(weights)
    shape_reqs = [
        {"op": "scale_shape", "shape": mk, "dim": 2, "columnwise": False} for mk in weights.values()
    ]
    te_shapes = ask_te(shape_reqs, tmp_path)
    stored = {
        n: _te_laid_out(_x(*mk, seed=i), tuple(s))
        for i, (n, mk, s) in enumerate(zip(names, weights.values(), te_shapes, strict=True))
    }
    deq_reqs = [
        {
            "op": "dequantize",
            "fmt": "e4m3",
            "is_2D_scaled": True,
            "rowwise_data": stored[n].rowwise_data,
            "rowwise_scale_inv": stored[n].rowwise_scale_inv,
            "columnwise_data": None,
            "columnwise_scale_inv": None,
        }
        for n in names
    ]
    te_deq = dict(zip(names, ask_te(deq_reqs, tmp_path), strict=True))
    ranges = {
        "q_proj": shape.qkv_row_ranges()["q"],
        "k_proj": shape.qkv_row_ranges()["k"],
        "v_proj": shape.qkv_row_ranges()["v"],
        "gate_proj": shape.fc1_row_ranges()["gate"],
        "up_proj": shape.fc1_row_ranges()["up"],
    }
    seen = []
    for n in names:
        assert not te_deq[n].isnan().any(), f"{n}: TE read a padding scale"
        for hf_name, q in ex.te_fp8_to_hf(n, stored[n], shape, pow2_scales=True).items():
            proj = hf_name.split(".")[-2]
            rows = ranges.get(proj, [(0, te_deq[n].shape[0])])
            ref = torch.cat([te_deq[n][a:b] for a, b in rows])
            assert torch.equal(_bits(q.dequantize(torch.float32)), _bits(ref)), hf_name
            seen.append(hf_name)
    assert len(seen) == len(ex.FP8_LINEARS)
