"""vLLM-native emulation: bit-exact to the golden vllm.* entries; reproduces DESIGN.md's table."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise
from nemo_jetrl.fp8.vllm_native import per_block_cast_native, quantize_group_native

# QuantFP8's smallest scale, vLLM's `_FP8_MIN_SCALING_FACTOR = 1.0 / (_FP8_MAX * 512.0)` (read in
# vllm/model_executor/layers/quantization/input_quant_fp8.py, 0.20 and 0.25; E4M3 max 448): a
# literal, so a wrong floor in vllm_native fails here.
VLLM_SCALE_FLOOR = 1.0 / (448.0 * 512.0)


@pytest.fixture(scope="module")
def golden(golden_dir):
    te = load_file(str(golden_dir / "te_golden_seed0.safetensors"))
    vl = load_file(str(golden_dir / "vllm_golden_seed0.safetensors"))
    meta = json.loads((golden_dir / "vllm_golden_seed0.json").read_text())
    return te, vl, meta


def _native(name_source: str):
    return quantize_group_native if "QuantFP8" in name_source else per_block_cast_native


def test_every_vllm_case_bit_exact(golden):
    te, vl, meta = golden
    assert len(meta) == 12
    for case, m in meta.items():
        q = _native(m["source"])(te[f"input.{m['input']}"], ue8m0=m["ue8m0"])
        assert torch.equal(fp8_bits(q.data), vl[f"{case}.q"]), case
        assert torch.equal(q.scale_inv.view(torch.int32), vl[f"{case}.scale"].view(torch.int32)), (
            case
        )


@pytest.mark.parametrize(
    ("name", "block", "fn", "bits", "deq", "total"),
    [
        ("act", (1, 128), quantize_group_native, 75, 73_332, 262_144),
        ("weight", (128, 128), per_block_cast_native, 318, 183_555, 786_432),
    ],
)
def test_design_table_te_fp32_vs_vllm_fp32(golden, name, block, fn, bits, deq, total):
    """DESIGN.md: FP32 scales differ (TE multiplies by RN(448/amax), vLLM divides by RN(amax/448))."""
    te, _, _ = golden
    x = te[f"input.{name}"]
    ours = quantize_blockwise(x, block, pow2_scales=False)
    theirs = fn(x, ue8m0=False)
    assert x.numel() == total
    assert int((fp8_bits(ours.data) != fp8_bits(theirs.data)).sum()) == bits
    assert int((ours.dequantize() != theirs.dequantize()).sum()) == deq
    # and with power-of-two scales the two formulas agree everywhere
    ours2, theirs2 = quantize_blockwise(x, block, pow2_scales=True), fn(x, ue8m0=True)
    assert torch.equal(fp8_bits(ours2.data), fp8_bits(theirs2.data))
    assert torch.equal(ours2.dequantize(), theirs2.dequantize())


def test_group_native_floor_and_nd_input():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 256, generator=g).to(torch.bfloat16)
    x[0, 1, :128] = 0
    x[1, 2, 128:] *= 1e-4  # amax < 1/512: floored scale
    q = quantize_group_native(x, ue8m0=True)
    assert q.data.shape == x.shape and q.scale_inv.shape == (2, 3, 2)
    assert float(q.scale_inv[0, 1, 0]) == pytest.approx(VLLM_SCALE_FLOOR, rel=1e-7)
    assert float(q.scale_inv[1, 2, 1]) == pytest.approx(VLLM_SCALE_FLOOR, rel=1e-7)
    flat = quantize_group_native(x.reshape(6, 256), ue8m0=True)
    assert torch.equal(fp8_bits(flat.data).reshape(x.shape), fp8_bits(q.data))


def test_per_block_native_rejects_nd():
    with pytest.raises(ValueError, match="w1"):
        per_block_cast_native(torch.zeros(2, 2, 2), ue8m0=True, name="w1")
