"""``jetrl/moe/routing_mismatch`` over several MoE layers (backends/local/routing.py): the
fraction of all compared top-k slots of all layers, not the last layer's count. The controller
is the real one over a real tiny Mixtral (two MoE layers); the choices are set directly, as the
rollout and trainer forwards record them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_local_moe import _moe_config

from nemo_jetrl.backends.local.model import build_model
from nemo_jetrl.backends.local.moe import convert_moe_blocks
from nemo_jetrl.backends.local.routing import (
    ROUTING_CAPTURED,
    ROUTING_MISMATCH,
    RoutingController,
)
from nemo_jetrl.recipe import Recipe


def test_mismatch_is_the_fraction_over_every_layer():
    model = build_model(_moe_config("mixtral"), seed=0, dtype=torch.bfloat16)
    convert_moe_blocks(model, Recipe.preset("bf16").train, None)
    ctl = RoutingController(model, model, replay=False)
    assert len(ctl.train_blocks) == 2
    P, R = 2, 3
    roll = torch.zeros(1, P + R - 1, 2, dtype=torch.int32)
    roll[..., 1] = 1
    own = [torch.cat([roll, roll[:, :1]], dim=1) for _ in range(2)]
    own[0] = own[0].clone()
    own[0][0, P - 1, 1] = 3  # layer 0: one slot of 3 tokens x 2 slots differs; layer 1: none
    mask = torch.ones(1, R, dtype=torch.bool)
    ctl.rollout_choices, ctl.train_choices = [roll, roll], own
    assert ctl.metrics(P, mask) == {ROUTING_MISMATCH: 1 / 12}
    ctl.train_choices = own[::-1]  # the differing layer last
    assert ctl.metrics(P, mask) == {ROUTING_MISMATCH: 1 / 12}
    # the engine's capture held 2 of the 3 response positions: those are compared, both layers
    ctl.rollout_valid = torch.tensor([[True, True, False, True]])
    assert ctl.metrics(P, mask) == {ROUTING_CAPTURED: 2 / 3, ROUTING_MISMATCH: 1 / 8}
