"""Module swap: which layers become FP8, which stay BF16 and why; parameters are shared."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.convert import convert_to_fp8_inference, convert_to_fp8_training
from nemo_jetrl.fp8.inference_linear import Fp8InferenceLinear
from nemo_jetrl.fp8.linear import Fp8BlockLinear


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(256)
        self.up = nn.Linear(256, 512)
        self.down = nn.Linear(512, 256, bias=False)
        self.router = nn.Linear(256, 128)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x)))) + 0 * self.router(x).sum()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 256)
        self.layers = nn.ModuleList([Block(), Block()])
        self.odd = nn.Linear(256, 100)  # not a multiple of 128
        self.lm_head = nn.Linear(256, 384)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h) + self.odd(h).sum()


def _keep(mod, name):
    return not (name.endswith("router") or name == "lm_head")


def test_training_conversion_swaps_and_reports(caplog):
    torch.manual_seed(0)
    model = Tiny().to(torch.bfloat16)
    params = {n: p for n, p in model.named_parameters()}
    with caplog.at_level(logging.INFO, logger="nemo_jetrl.fp8.convert"):
        report = convert_to_fp8_training(model, Fp8LinearConfig(), module_filter_fn=_keep)
    assert report.converted == ("layers.0.up", "layers.0.down", "layers.1.up", "layers.1.down")
    assert report.kept == {
        "layers.0.router": "rejected by module_filter_fn",
        "layers.1.router": "rejected by module_filter_fn",
        "odd": "dims (100, 256): out_features=100 is not a multiple of 8 (Transformer Engine's "
        "FP8 GEMM rule; partial 128-blocks are fine)",
        "lm_head": "rejected by module_filter_fn",
    }
    assert isinstance(model.layers[1].down, Fp8BlockLinear)
    assert type(model.lm_head) is nn.Linear and type(model.odd) is nn.Linear
    assert model.layers[0].up.name == "layers.0.up"
    # same Parameter objects: an optimizer built before the swap still updates the model
    assert all(p is params[n] for n, p in model.named_parameters())
    assert "kept odd: dims (100, 256)" in caplog.text and "fp8  layers.1.up" in caplog.text
    out = model(torch.tensor([[1, 2, 3]]))
    out.float().sum().backward()
    assert model.layers[0].up.weight.grad is not None
    # converting again is a no-op (FP8 layers are not nn.Linear any more)
    again = convert_to_fp8_training(model, module_filter_fn=_keep)
    assert again.converted == ()


def test_inference_conversion_matches_training_set_and_forward():
    torch.manual_seed(0)
    train = Tiny().to(torch.bfloat16)
    infer = Tiny().to(torch.bfloat16)
    infer.load_state_dict(train.state_dict())
    cfg = Fp8LinearConfig.te_blockwise()
    r1 = convert_to_fp8_training(train, cfg, module_filter_fn=_keep)
    r2 = convert_to_fp8_inference(infer, cfg, module_filter_fn=_keep)
    assert r1 == r2
    assert isinstance(infer.layers[0].up, Fp8InferenceLinear)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(train(ids), infer(ids))


def test_converting_a_bare_linear_is_an_error():
    with pytest.raises(ValueError, match=r"contains the nn\.Linear"):
        convert_to_fp8_training(nn.Linear(128, 128))
