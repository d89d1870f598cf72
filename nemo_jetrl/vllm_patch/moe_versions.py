"""What our experts kernel (``experts.py``) needs to know about each vLLM release it covers.

* 0.20.0: ``FusedMoE`` holds the expert weights, the router and the quant method; its router
  calls ``_moe_C.topk_softmax`` for a non-monolithic method.
* 0.25.1 (NeMo-RL main's): ``FusedMoE(...)`` is a factory returning a ``MoERunner`` that holds a
  ``RoutedExperts`` (weights, quant method, routing attributes) and the router. The router still
  calls ``_moe_C.topk_softmax``; vLLM's routed-experts capture hooks the runner's router.
* 0.32.x: as 0.25.1, plus a CPU router (``fused_moe/router/cpu_router.py``).

No vLLM CPU build before 0.32 has ``topk_softmax``, so on those releases our method is
monolithic and routes itself (`experts.route_softmax_topk`), as it then must also feed vLLM's
routed-experts capture (`router_capture_fn`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from nemo_jetrl.vllm_patch import compat

# Releases the experts kernel was written and engine-tested for (0.33: source only, refused).
MOE_RANGES = (((0, 20, 0), (0, 20, 1)), ((0, 25, 1), (0, 25, 2)), ((0, 32, 0), (0, 33, 0)))
COVERED = "0.20.0, 0.25.1, 0.32.x"
# vLLM's own routing on a CPU build is available from this release (its CPU router).
CPU_ROUTER_SINCE = (0, 32, 0)


def moe_supported(version: str) -> bool:
    """Whether our experts kernel covers vLLM ``version``."""
    rel = compat.release(version)
    return any(lo <= rel < hi for lo, hi in MOE_RANGES)


def own_routing(version: str) -> bool:
    """Whether our method routes itself (monolithic) on vLLM ``version``: below 0.32 vLLM's
    router needs ``_moe_C.topk_softmax``, which CPU builds lack (`vllm_routes_on_cpu`)."""
    return compat.release(version) < CPU_ROUTER_SINCE


def vllm_routes_on_cpu() -> bool:
    """Whether the installed vLLM can route experts on a CPU for a non-monolithic method: it has
    a CPU router module or the ``topk_softmax`` op (tests check `own_routing` against this)."""
    import torch
    import vllm._custom_ops  # noqa: F401  (loads vLLM's op libraries)

    cpu_router = "vllm.model_executor.layers.fused_moe.router.cpu_router"
    return importlib.util.find_spec(cpu_router) is not None or hasattr(
        torch.ops._moe_C, "topk_softmax"
    )


def router_capture_fn(layer: Any) -> Callable[[Any], None] | None:
    """vLLM's routed-experts capture (``enable_return_routed_experts``) for ``layer``, the module
    our method is called with; None when the engine records none. 0.20: ``layer.router``. 0.25+:
    the router of the ``MoERunner`` registered under ``layer.layer_name`` (vLLM binds the
    capture there after the KV cache is made, so it is looked up per call)."""
    router = getattr(layer, "router", None)
    if router is None:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return None
        runner = get_forward_context().no_compile_layers.get(getattr(layer, "layer_name", None))
        router = getattr(runner, "router", None)
    return getattr(router, "capture_fn", None)
