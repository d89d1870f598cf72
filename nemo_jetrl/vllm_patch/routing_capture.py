"""The experts a running vLLM engine routed each token to, per request and position.

vLLM's own ``enable_return_routed_experts`` is refused by the 0.32 CPU build (it needs Model
Runner V2, which needs Triton). Its routers (``BaseRouter``, 0.32) do expose the hook it uses,
``router.set_capture_fn(fn)``: ``fn(topk_ids)`` is called with the logical expert ids of every
routed row, in vLLM's router, whichever experts kernel runs next (vLLM's own BF16 CPU experts or
our FP8 experts kernel). `RoutingRecorder` sets that hook on an engine's routers **at run time,
inside the worker** (through the worker extension's ``jetrl_routing_capture``; nothing is patched
at import, and with the recorder off the hook is None, vLLM's default). Each call keeps a copy
of ``topk_ids`` and, at the first MoE layer of a forward, the model runner's layout of that
forward (request ids, ``query_start_loc``, ``positions``), so every row maps to
``(request, position)``: prefill chunks, decode steps and continuous batching alike.
``jetrl_routing_take`` returns and clears what was recorded, per request: the positions the
engine computed and their experts ``[n, moe_layers, top_k]``.

Cost while on: one host copy of ``topk_ids`` per MoE layer per forward and of the layout per
forward (k int32 per token per layer); nothing while off. On a CPU engine these copies are
host-to-host; on a GPU each would be a device-to-host copy (not used there: the NeMo-RL path has
vLLM's own capture).

`capture_problem` says, in the driver and before any engine starts, why the installed vLLM
cannot be recorded this way (None: it can).
"""

from __future__ import annotations

import re
from typing import Any

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def capture_problem() -> str | None:
    """Why the installed vLLM's routing cannot be recorded (None: it can)."""
    try:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    except ImportError as exc:
        return f"this vLLM has no fused-MoE BaseRouter to hook ({exc}); vLLM 0.32 has"
    if not callable(getattr(BaseRouter, "set_capture_fn", None)):
        return "this vLLM's BaseRouter has no set_capture_fn hook (vLLM 0.32 has)"
    return None


def routes_inside_its_kernel(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s experts kernel takes the router logits and routes itself without
    calling the router's capture hook: vLLM's own ``is_monolithic`` methods (e.g. vLLM 0.20's CPU
    BF16 experts). Ours, monolithic below vLLM 0.32, calls the hook (`experts.py`)."""
    method = getattr(layer, "quant_method", None)
    ours = hasattr(method, "jetrl_settings_json")
    return bool(getattr(method, "is_monolithic", False)) and not ours


def _routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router) of every MoE layer with a capture hook that its forward
    calls, in layer order."""
    out = []
    for name, m in model.named_modules():
        router = getattr(m, "router", None)
        if router is None or not callable(getattr(router, "set_capture_fn", None)):
            continue
        if routes_inside_its_kernel(m):
            continue
        match = _LAYER.search(f"{name}.")
        out.append((int(match.group(1)) if match else -1, router))
    return sorted(out, key=lambda t: t[0])


class RoutingRecorder:
    """Worker side: records every routed row of the engine's forwards (module docstring)."""

    def __init__(self, model: torch.nn.Module, runner: Any) -> None:
        self.runner = runner
        self.routers = _routers(model)
        self.forwards: list[dict[str, Any]] = []
        self.skipped = 0
        """Forwards with no request layout (vLLM's dummy / profiling runs): not recorded."""

    @property
    def layers(self) -> list[int]:
        return [i for i, _ in self.routers]

    def install(self) -> None:
        for slot, (_, router) in enumerate(self.routers):
            router.set_capture_fn(lambda ids, slot=slot: self._capture(slot, ids))

    def uninstall(self) -> None:
        for _, router in self.routers:
            router.set_capture_fn(None)

    def _layout(self, rows: int) -> dict[str, Any] | None:
        r = self.runner
        num_reqs = int(r.input_batch.num_reqs)
        if num_reqs == 0:
            return None
        qsl = r.query_start_loc.cpu[: num_reqs + 1].to(torch.int64).clone()
        n = int(qsl[-1])
        if n == 0 or n > rows:
            return None
        return {
            "req_ids": list(r.input_batch.req_ids[:num_reqs]),
            "qsl": qsl,
            "pos": r.positions[:n].to("cpu", torch.int64, copy=True),
            "ids": [None] * len(self.routers),
        }

    def _capture(self, slot: int, topk_ids: torch.Tensor) -> None:
        if slot == 0:
            layout = self._layout(topk_ids.shape[0])
            if layout is None:
                self.skipped += 1
            self.forwards.append(layout)
        if not self.forwards or self.forwards[-1] is None:
            return
        fwd = self.forwards[-1]
        fwd["ids"][slot] = topk_ids[: fwd["pos"].numel()].to("cpu", torch.int32, copy=True)

    def take(self) -> dict[str, torch.Tensor]:
        """``{f"{req_id}|pos": [n] int64, f"{req_id}|ids": [n, layers, k] int32}`` of every
        request seen since the last take (a position computed twice keeps the last), cleared."""
        rows: dict[str, dict[int, torch.Tensor]] = {}
        for fwd in self.forwards:
            if fwd is None or any(t is None for t in fwd["ids"]):
                continue
            ids = torch.stack(fwd["ids"], dim=1)  # [n, layers, k]
            bounds = fwd["qsl"].tolist()
            for i, rid in enumerate(fwd["req_ids"]):
                per = rows.setdefault(rid, {})
                for row in range(bounds[i], bounds[i + 1]):
                    per[int(fwd["pos"][row])] = ids[row]
        self.forwards = []
        out = {}
        for rid, per in rows.items():
            pos = sorted(per)
            out[f"{rid}|pos"] = torch.tensor(pos, dtype=torch.int64)
            out[f"{rid}|ids"] = torch.stack([per[p] for p in pos])
        return out


def start(llm: Any) -> list[int]:
    """Turn the recorder on in the engine's worker(s); the decoder layers it hooks (none: the
    model has no router vLLM lets us hook)."""
    return llm.collective_rpc("jetrl_routing_capture", args=(True,))[0]


def stop(llm: Any) -> None:
    llm.collective_rpc("jetrl_routing_capture", args=(False,))


def take(llm: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{engine request id: (positions [n], experts [n, layers, k])}`` recorded since the
    last take (worker 0: the recorder supports ``tensor_parallel_size=1``)."""
    from safetensors.torch import load  # the worker packs with worker_ext.pack (safetensors)

    flat = load(bytes(llm.collective_rpc("jetrl_routing_take")[0]))
    out = {}
    for key, pos in flat.items():
        rid, _, kind = key.rpartition("|")
        if kind == "pos":
            out[rid] = (pos, flat[f"{rid}|ids"])
    return out


def for_request(
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]], request_id: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The capture of the request the caller knows as ``request_id``: vLLM >= 0.32 runs it
    under ``f"{request_id}-{random suffix}"`` inside the engine."""
    if request_id in captured:
        return captured[request_id]
    hits = [v for k, v in captured.items() if k.rpartition("-")[0] == request_id]
    return hits[0] if len(hits) == 1 else None
