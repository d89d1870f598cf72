"""`vllm_patch.shared_experts.check_runner_runs_shared` on labelled stand-ins for vLLM's
``SharedExperts`` wrapper and quant method (no vLLM needed; the real engines are in
test_vllm_moe_shared.py, where vLLM 0.32 hands the wrapper to our method on every MoE call)."""

from __future__ import annotations

import types

import pytest

from nemo_jetrl.vllm_patch.shared_experts import (
    SharedExpertsNotRun,
    check_runner_runs_shared,
    method_owns_shared,
)

LAYER = types.SimpleNamespace(layer_name="model.layers.3.mlp.experts")


def _method(**owns: bool) -> types.SimpleNamespace:
    """Stand-in quant method: vLLM 0.20 spells ownership mk_owns_shared_expert, 0.25+
    mk_can_overlap_shared_experts (both False for ours: no moe_kernel)."""
    return types.SimpleNamespace(**owns)


def _wrapper(ran: bool, idx: int = 0) -> types.SimpleNamespace:
    """Stand-in for vLLM 0.32's SharedExperts: one output slot per DBO micro-batch."""
    slots = [None, None]
    if ran:
        slots[idx] = object()
    return types.SimpleNamespace(_output=slots, _output_idx=idx)


def test_no_shared_experts_or_already_run_passes():
    check_runner_runs_shared(_method(), LAYER, None)
    check_runner_runs_shared(_method(mk_can_overlap_shared_experts=False), LAYER, _wrapper(True))
    check_runner_runs_shared(_method(), LAYER, _wrapper(True, idx=1))  # second micro-batch


@pytest.mark.parametrize("attr", ["mk_owns_shared_expert", "mk_can_overlap_shared_experts"])
def test_a_method_that_would_own_them_is_refused_naming_the_layer(attr):
    assert method_owns_shared(_method(**{attr: True}))
    with pytest.raises(SharedExpertsNotRun, match=r"model\.layers\.3\.mlp\.experts.*moe_kernel"):
        check_runner_runs_shared(_method(**{attr: True}), LAYER, _wrapper(True))


def test_shared_experts_not_run_before_the_routed_experts_are_refused():
    with pytest.raises(SharedExpertsNotRun, match=r"model\.layers\.3\.mlp\.experts.*not run"):
        check_runner_runs_shared(_method(), LAYER, _wrapper(False))
    with pytest.raises(SharedExpertsNotRun):  # the other micro-batch's slot does not count
        check_runner_runs_shared(
            _method(), LAYER, types.SimpleNamespace(_output=[object(), None], _output_idx=1)
        )
