"""Shared experts beside our block-FP8 experts kernel (Qwen2-MoE / Qwen3-Next / Qwen3.5-MoE
``mlp.shared_expert`` + ``shared_expert_gate``, DeepSeek-V2/V3 and Moonlight
``mlp.shared_experts``).

A shared expert is an ordinary MLP of vLLM linears built with the model's quant_config, so under
``apply_patches`` its ``gate_up_proj`` / ``down_proj`` run our dense kernel (block-FP8 from the
checkpoint or the refit; reported by the guard like any dense linear). Qwen's
``shared_expert_gate`` [1, hidden] is a ``ReplicatedLinear`` built with ``quant_config=None`` in
vLLM 0.20, 0.25.1 and 0.32 (BF16; the shared-expert MLP applies ``sigmoid(gate(x)) * out``).

Who runs it (read from vLLM's ``fused_moe/runner``): the MoE runner wraps the module in
``SharedExperts`` and runs it itself unless the quant method's kernel owns it
(0.20 ``mk_owns_shared_expert``, 0.25.1 / 0.32 ``mk_can_overlap_shared_experts``: both need a
vLLM ``moe_kernel``, which our method never builds). It runs it before our method (on CPU, or
on a GPU above ``VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD`` tokens) or on an auxiliary CUDA
stream launched before it, and then adds ``shared_output + routed_output`` in the model dtype
(one BF16 add; commutative, so HF's ``routed + shared`` has the same bits). 0.25.1 / 0.32 still
pass the wrapper to ``apply(shared_experts=...)``: it is already computed there, and running it
again would compute it twice (and trip the wrapper's single-output slot). So our method leaves
it to the runner and only checks that the runner did run it (`check_runner_runs_shared`).
"""

from __future__ import annotations

from typing import Any


class SharedExpertsNotRun(RuntimeError):
    """vLLM handed our experts method shared experts it expects the method to run."""


def method_owns_shared(method: Any) -> bool:
    """Whether vLLM would leave the shared experts to ``method``'s kernel (0.20's and 0.25+'s
    spellings of the property)."""
    return any(
        bool(getattr(method, attr, False))
        for attr in ("mk_owns_shared_expert", "mk_can_overlap_shared_experts")
    )


def check_runner_runs_shared(method: Any, layer: Any, shared_experts: Any) -> None:
    """Called by our method's ``apply`` with what vLLM passed as ``shared_experts`` (None: no
    shared experts, or 0.20, which does not pass them). Raises `SharedExpertsNotRun` naming the
    layer when the runner would not have run them: our method owning them, or no output in the
    wrapper's slot (0.25.1 / 0.32 ``SharedExperts._output``) when our method is called."""
    if shared_experts is None:
        return
    name = getattr(layer, "layer_name", type(layer).__name__)
    if method_owns_shared(method):
        raise SharedExpertsNotRun(
            f"nemo_jetrl experts kernel: vLLM leaves {name}'s shared experts to the quant "
            "method's kernel, which nemo_jetrl does not build (moe_kernel must stay None)"
        )
    slots = getattr(shared_experts, "_output", None)
    idx = getattr(shared_experts, "_output_idx", 0)
    if isinstance(slots, list) and isinstance(idx, int) and slots[idx] is None:
        raise SharedExpertsNotRun(
            f"nemo_jetrl experts kernel: {name}'s shared experts were not run by vLLM's MoE "
            "runner before the routed experts; this vLLM's shared-expert order is not covered"
        )
