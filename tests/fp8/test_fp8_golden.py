"""Bit-exactness of `quantize_blockwise` against the golden vectors (TE reference and vLLM UE8M0)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise

TE_CASES = [
    "te.act.pow2", "te.act.pow2.colwise", "te.act.fp32", "te.act.fp32.colwise",
    "te.edge.pow2", "te.edge.pow2.colwise", "te.edge.fp32", "te.edge.fp32.colwise",
    "te.act_ragged.pow2", "te.act_ragged.pow2.colwise", "te.act_ragged.fp32",
    "te.act_ragged.fp32.colwise", "te.weight.pow2", "te.weight.fp32", "te.weight_fp32.pow2",
    "te.weight_fp32.fp32", "te.weight_ragged.pow2", "te.weight_ragged.fp32",
]  # fmt: skip
VLLM_INPUTS = {"act": (1, 128), "act_ragged": (1, 128), "edge": (1, 128)} | {
    w: (128, 128) for w in ("weight", "weight_fp32", "weight_ragged")
}


@pytest.fixture(scope="module")
def te(golden_dir):
    return load_file(str(golden_dir / "te_golden_seed0.safetensors"))


@pytest.fixture(scope="module")
def te_meta(golden_dir):
    return json.loads((golden_dir / "te_golden_seed0.json").read_text())["cases"]


@pytest.fixture(scope="module")
def vllm(golden_dir):
    return load_file(str(golden_dir / "vllm_golden_seed0.safetensors"))


def test_golden_index_lists_exactly_the_cases_we_test(te_meta):
    assert sorted(te_meta) == sorted(TE_CASES)


@pytest.mark.parametrize("case", TE_CASES)
def test_te_case_bit_exact(case, te, te_meta):
    meta = te_meta[case]
    x = te[f"input.{meta['input']}"]
    block = tuple(meta["block"])
    q = quantize_blockwise(x, block, fmt="e4m3", pow2_scales=meta["pow2"], eps=meta["eps"])
    data, scale_inv = fp8_bits(q.data), q.scale_inv
    if block == (128, 1):  # golden columnwise entries are stored transposed: [K, M]
        data, scale_inv = data.t(), scale_inv.t()
    want_q, want_s = te[f"{case}.q"], te[f"{case}.scale_inv"]
    assert data.shape == want_q.shape and scale_inv.shape == want_s.shape
    n_bad = int((data != want_q).sum())
    assert n_bad == 0, f"{case}: {n_bad} FP8 bytes differ"
    assert torch.equal(scale_inv.view(torch.int32), want_s.view(torch.int32)), f"{case}: scale_inv"
    # pow2 mode really is power-of-two (frexp mantissa 0.5; 2**-127 is an fp32 subnormal)
    if meta["pow2"]:
        assert bool((torch.frexp(scale_inv.double()).mantissa == 0.5).all())


def _block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bm, bk = block
    m, k = x.shape
    mb, kb = -(-m // bm), -(-k // bk)
    xp = torch.nn.functional.pad(x.float().abs(), (0, kb * bk - k, 0, mb * bm - m))
    return xp.reshape(mb, bm, kb, bk).amax(dim=(1, 3))


def _expand(mask: torch.Tensor, block, shape) -> torch.Tensor:
    bm, bk = block
    return mask.repeat_interleave(bm, 0).repeat_interleave(bk, 1)[: shape[0], : shape[1]]


@pytest.mark.parametrize("name", sorted(VLLM_INPUTS))
def test_vllm_ue8m0_agrees_with_pow2_where_readme_says(name, te, vllm):
    """Equal bits except in groups below vLLM's floors; equal scales except floored/zero blocks.

    vLLM's group path floors its scale at 1/(448*512), which bites when amax < 1/512; its block
    path floors amax at 1e-4 (only all-zero blocks here). TE stores scale_inv 1.0 for zero blocks.
    """
    block = VLLM_INPUTS[name]
    x = te[f"input.{name}"]
    ours = quantize_blockwise(x, block, pow2_scales=True)
    want_q, want_s = vllm[f"vllm.{name}.ue8m0.q"], vllm[f"vllm.{name}.ue8m0.scale"]
    amax = _block_amax(x, block)
    floored = amax < (1.0 / 512 if block == (1, 128) else 1e-4)  # vLLM's floor bites here
    tiny = floored & (amax > 0)  # floored but not zero: where the bits may differ
    elem_mask = _expand(tiny, block, x.shape)
    got = fp8_bits(ours.data)
    assert torch.equal(got[~elem_mask], want_q[~elem_mask])
    assert torch.equal(ours.scale_inv[~floored], want_s[~floored])
    assert torch.equal(ours.scale_inv[amax == 0], torch.ones(int((amax == 0).sum())))
    # the exceptions are real, not vacuous, exactly where the README says
    if name == "edge":
        assert int(tiny.sum()) > 0
        assert int((got[elem_mask] != want_q[elem_mask]).sum()) > 0
        assert not torch.equal(ours.scale_inv[tiny], want_s[tiny])
    else:
        assert int(tiny.sum()) == 0
    if name in ("act", "weight"):
        assert int((amax == 0).sum()) > 0  # the README's all-zero blocks
