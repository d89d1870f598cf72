"""`vllm_patch.cpu_fixes` without vLLM: what counts as an entry to fix, and the handle."""

from __future__ import annotations

import sys

from nemo_jetrl.vllm_patch import cpu_fixes


class SiluAndMul:  # stands for vLLM's CustomOp: building it is what fails in vLLM 0.20's forward
    @staticmethod
    def forward_native(x):
        return x


def test_only_a_lambda_that_builds_the_custom_op_is_fixed():
    builds = lambda x: SiluAndMul().forward_native(x)  # noqa: E731 (vLLM 0.20's entry, verbatim shape)
    static = SiluAndMul.forward_native  # vLLM 0.25's kind of entry: builds nothing
    other = lambda x: x * 2  # noqa: E731
    assert cpu_fixes.builds_custom_op(builds)
    assert not cpu_fixes.builds_custom_op(static) and not cpu_fixes.builds_custom_op(other)
    assert not cpu_fixes.builds_custom_op(None)


def test_apply_without_vllms_cpu_moe_changes_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.fused_moe.cpu_fused_moe", None)
    handle = cpu_fixes.apply()
    assert handle.applied == ()
    handle.revert()


def test_revert_undoes_in_reverse_order_once():
    done = []
    handle = cpu_fixes.CpuFixes(("a", "b"), [lambda: done.append("a"), lambda: done.append("b")])
    handle.revert()
    handle.revert()
    assert done == ["b", "a"] and handle.applied == ()
