"""`vllm_patch.cpu_fixes` on the installed vLLM (the vLLM tiers).

vLLM 0.20's CPU MoE fallback builds ``SiluAndMul`` inside its forward, which fails outside a vLLM
config (the engines of test_vllm_moe, test_vllm_moe_shared and test_local_vllm_moe died at their
profile run on an AMD EPYC without AVX-512, 2026-11-29: "Current vLLM config is not set"). 0.25's
entry builds nothing and 0.32 has no such table (read in their sources): nothing to fix there.
"""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.vllm_patch import cpu_fixes

pytestmark = pytest.mark.vllm


def test_the_fix_applies_only_where_vllm_builds_silu_in_its_cpu_moe_forward():
    import vllm

    from nemo_jetrl.vllm_patch.compat import release

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    want = torch.nn.functional.silu(x[:, :16]) * x[:, 16:]
    if release(vllm.__version__)[:2] != (0, 20):
        handle = cpu_fixes.apply()
        assert handle.applied == ()
        return
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import _CPU_MOE_ACT_FN as table

    if table[MoEActivation.SILU] is SiluAndMul.forward_native:
        # an in-process engine of an earlier test in this worker loaded our plugin with the fix
        # requested: it holds vLLM's own entry, and a second apply changes nothing
        assert cpu_fixes.builds_custom_op(cpu_fixes.replaced()[cpu_fixes.SILU])
        assert cpu_fixes.apply().applied == ()
        assert torch.equal(table[MoEActivation.SILU](x), want)
        return
    original = table[MoEActivation.SILU]
    assert cpu_fixes.replaced() == {}
    # the upstream fault: building SiluAndMul in the forward (whether it raises here depends on
    # the vLLM config this process last set; in the engine's forward none is: the MoE engines of
    # this tier fail to start without the fix)
    assert cpu_fixes.builds_custom_op(original)
    handle = cpu_fixes.apply()
    try:
        assert handle.applied == (cpu_fixes.SILU,)
        assert cpu_fixes.replaced() == {cpu_fixes.SILU: original}
        assert torch.equal(table[MoEActivation.SILU](x), want)  # builds nothing now
        assert cpu_fixes.apply().applied == ()  # idempotent
    finally:
        handle.revert()
    assert table[MoEActivation.SILU] is original
    assert cpu_fixes.replaced() == {}
