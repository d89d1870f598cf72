"""Partial blocks, TE-exact: `quantize_blockwise` and the Triton kernels on TE's tail vectors.

``te_golden_tails_seed0`` (made by scripts/make_te_golden_tails.py from Transformer Engine's own
pure-PyTorch blockwise reference, commit d0067d0) has tails in both dims (576x512, 32x1024,
200x300, 130x257 weights; 77x300 and 33x130 activations, rowwise and columnwise), both scale
modes. A partial block's amax is over its valid elements only: padding never counts, and memory
past the tail (a strided view of a bigger tensor) is never read.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from triton_setup import DEVICE, TRITON_MARKS

from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise

FILE = "te_golden_tails_seed0"
INPUT_SHAPES = {
    "act_tail": (77, 300), "act_tail_fp16": (33, 130), "weight_mla": (576, 512),
    "weight_inproj": (32, 1024), "weight_tail2": (200, 300), "weight_tail_fp32": (130, 257),
}  # fmt: skip


@pytest.fixture(scope="module")
def tails(golden_dir):
    te = load_file(str(golden_dir / f"{FILE}.safetensors"))
    meta = json.loads((golden_dir / f"{FILE}.json").read_text())["cases"]
    return te, meta


def _cases():
    out = []
    for name in INPUT_SHAPES:
        blocks = ["", ".colwise"] if name.startswith("act") else [""]
        out += [f"te.{name}.{m}{c}" for m in ("pow2", "fp32") for c in blocks]
    return out


CASES = _cases()


def _want(te, case):
    return te[f"{case}.q"], te[f"{case}.scale_inv"]


def _check(case, data, scale_inv, te):
    want_q, want_s = _want(te, case)
    assert data.shape == want_q.shape and scale_inv.shape == want_s.shape, case
    n_bad = int((fp8_bits(data.cpu().contiguous()) != want_q).sum())
    assert n_bad == 0, f"{case}: {n_bad} FP8 bytes differ from TE"
    got_s = scale_inv.cpu().contiguous().view(torch.int32)
    n_bad = int((got_s != want_s.view(torch.int32)).sum())
    assert n_bad == 0, f"{case}: {n_bad} scale_inv values differ from TE"


def test_index_lists_every_case_and_every_input_has_tails(tails):
    te, meta = tails
    assert sorted(meta) == sorted(CASES)
    for name, shape in INPUT_SHAPES.items():
        assert tuple(te[f"input.{name}"].shape) == shape
        assert shape[0] % 128 or shape[1] % 128, name  # a tail somewhere
    assert any(m % 128 and k % 128 for m, k in INPUT_SHAPES.values())  # tails in both dims


@pytest.mark.parametrize("case", CASES)
def test_reference_quantizer_bit_exact(case, tails):
    te, meta = tails
    m = meta[case]
    x, block = te[f"input.{m['input']}"], tuple(m["block"])
    q = quantize_blockwise(x, block, fmt="e4m3", pow2_scales=m["pow2"], eps=m["eps"])
    data, s = (q.data.t(), q.scale_inv.t()) if block == (128, 1) else (q.data, q.scale_inv)
    _check(case, data, s, te)


@pytest.mark.parametrize("case", CASES)
def test_memory_past_the_tail_is_never_read(case, tails):
    """The input as a view into a bigger tensor whose extra rows/columns hold 1e4: same bits."""
    te, meta = tails
    m = meta[case]
    x, block = te[f"input.{m['input']}"], tuple(m["block"])
    big = torch.full((x.shape[0] + 128, x.shape[1] + 128), 1e4, dtype=x.dtype)
    big[: x.shape[0], : x.shape[1]] = x
    view = big[: x.shape[0], : x.shape[1]]
    q = quantize_blockwise(view, block, fmt="e4m3", pow2_scales=m["pow2"])
    data, s = (q.data.t(), q.scale_inv.t()) if block == (128, 1) else (q.data, q.scale_inv)
    _check(case, data, s, te)
    # the neighbours would change the answer if they were counted: the vectors can tell
    whole = quantize_blockwise(big, block, fmt="e4m3", pow2_scales=m["pow2"])
    crop = whole.data[: x.shape[0], : x.shape[1]]
    crop = crop.t() if block == (128, 1) else crop
    assert not torch.equal(fp8_bits(crop.contiguous()), _want(te, case)[0]), case


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", ["compact", "mn_major"])
def test_triton_kernel_bit_exact(case, layout, tails):
    from nemo_jetrl.fp8.triton_kernels import mn_major_storage, quantize_blockwise_triton

    te, meta = tails
    m = meta[case]
    x, block = te[f"input.{m['input']}"].to(DEVICE), tuple(m["block"])
    colwise = block == (128, 1)
    q = quantize_blockwise_triton(
        x, block, pow2_scales=m["pow2"], eps=m["eps"], transpose=colwise, scale_layout=layout
    )
    _check(case, q.data, q.scale_inv, te)  # mn_major: a strided view of the same values
    if layout == "mn_major":  # the rows past ceil(M/128)'s multiple of 4 hold zeros
        store = mn_major_storage(q.scale_inv)
        assert not bool(store[:, q.scale_inv.shape[0] :].any()), case


for _mark in TRITON_MARKS:
    test_triton_kernel_bit_exact = _mark(test_triton_kernel_bit_exact)
