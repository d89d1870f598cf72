"""The refit parity check (`refit.check_parity`) against a stand-in engine reader: bit for bit,
so a -0.0 where +0.0 was sent, one flipped FP8 byte, or a tensor the engine does not return
each fail the refit; an exact copy passes."""

from __future__ import annotations

import re

import pytest
import torch

from nemo_jetrl.vllm_patch.refit import ParityError, QuantizedStateDict, check_parity

LAYER = "model.layers.0.mlp.up_proj"


def _qsd() -> QuantizedStateDict:
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7E, (128, 128), generator=g, dtype=torch.uint8)
    tensors = {
        f"{LAYER}.weight": bits.view(torch.float8_e4m3fn),
        f"{LAYER}.weight_scale_inv": torch.tensor([[0.125]], dtype=torch.float32),
        "model.norm.weight": torch.tensor([1.0, 0.0, -2.5, 0.0], dtype=torch.bfloat16),
    }
    return QuantizedStateDict(tensors, (LAYER,), ("model.norm.weight",))


def _reader(engine: dict[str, torch.Tensor]):
    def read(names, through_kernel):
        for n in names:
            if n in engine:
                yield n, engine[n]

    return read


def _engine(qsd: QuantizedStateDict) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in qsd.tensors.items()}


def test_an_exact_copy_passes() -> None:
    qsd = _qsd()
    report = check_parity(None, qsd, read=_reader(_engine(qsd)))
    assert report.differing == () and report.compared == 3 and report.fp8 == 2


def test_negative_zero_for_positive_zero_fails() -> None:
    qsd = _qsd()
    engine = _engine(qsd)
    engine["model.norm.weight"][1] = -0.0  # equal as a value, other bits
    with pytest.raises(ParityError, match=re.escape("model.norm.weight")):
        check_parity(None, qsd, read=_reader(engine))


def test_one_flipped_fp8_byte_fails() -> None:
    qsd = _qsd()
    engine = _engine(qsd)
    raw = engine[f"{LAYER}.weight"].view(torch.uint8)
    raw[3, 7] ^= 0x01
    with pytest.raises(ParityError, match=re.escape(f"{LAYER}.weight (1 of 16384 bytes")):
        check_parity(None, qsd, read=_reader(engine))


@pytest.mark.parametrize("missing", [f"{LAYER}.weight_scale_inv", "model.norm.weight"])
def test_a_tensor_the_engine_does_not_return_fails(missing: str) -> None:
    qsd = _qsd()
    engine = _engine(qsd)
    del engine[missing]
    with pytest.raises(ParityError, match=re.escape(missing)):
        check_parity(None, qsd, read=_reader(engine))
