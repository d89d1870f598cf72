"""A refit keeps every tensor where a captured CUDA graph reads it.

A CUDA graph records device addresses, not Python names. vLLM captures its decode steps (and,
in ``FULL`` modes, the attention inside them) once, at start, and replays them for every
rollout after. A refit that *copies* into the captured tensors is seen by the graphs; one that
*rebinds* a name to a new tensor is not: the graph goes on reading the old storage (the old
values while something holds it, freed memory once nothing does), while every Python-side
read, our parity check included, sees the new tensor and passes.

Where that happens (read in vLLM's sources, 2026-12-01): NeMo-RL's refit ends with vLLM's
``process_weights_after_loading`` over the whole model (v0.7.0: after every IPC stream), and
in vLLM 0.20.0 and 0.25.1 MLA's ``process_weights_after_loading`` binds ``W_UK_T`` and
``W_UV`` (the decode path's BF16 ``kv_b_proj`` halves) to new tensors each time
(``self.W_UK_T = W_UK.permute(1, 2, 0)``); 0.32 copies into the old ones
(``replace_parameter(..., prefer_copy=True)``). On DeepSeek-V3 or Moonlight with CUDA graphs
every rollout after the first refit would decode with stale ``W_UK_T``/``W_UV``.

So around a refit on an engine that runs CUDA graphs (`captures_cuda_graphs`): `record` notes
which tensor object and storage every name of the model is bound to (references only, no
copies; the KV cache left out as in ``rollback``), and after the transport `keep_in_place`
copies each moved tensor's new values into the storage the graphs read and binds the name back
to it. A tensor whose shape, dtype or strides changed cannot go back: it is named and refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nemo_jetrl.vllm_patch.refit_kv import RefitError
from nemo_jetrl.vllm_patch.rollback import KvCache, rebind, tensor_items


@dataclass(frozen=True)
class Binding:
    kind: str
    """"param", "buffer" or "attr" (where the name lives)."""
    obj: torch.Tensor
    """The tensor object bound to the name before the refit."""
    data: torch.Tensor
    """An alias of its storage then (the graphs' addresses)."""


Bindings = dict[str, dict[str, Binding]]
"""{module name: {tensor name: Binding}}."""


def captures_cuda_graphs(vllm_config: Any, device: torch.device) -> bool:
    """Whether the engine replays captured CUDA graphs: a CUDA device, ``enforce_eager`` off
    and a ``cudagraph_mode`` other than NONE (vLLM 0.20, 0.25, 0.32 name it so)."""
    if device.type != "cuda" or bool(getattr(vllm_config.model_config, "enforce_eager", False)):
        return False
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return mode is not None and getattr(mode, "name", str(mode)) != "NONE"


def record(model: torch.nn.Module, runner: Any = None) -> Bindings:
    """What every tensor name of ``model`` is bound to now (the KV cache left out)."""
    kv = KvCache.of(model, runner)
    return {
        name: {n: Binding(kind, t, t.data) for n, (kind, t) in tensor_items(m, kv).items()}
        for name, m in model.named_modules()
    }


def _moved(b: Binding, now: torch.Tensor) -> bool:
    """Whether a graph would read other memory than ``now`` (a new object around the same
    storage and layout, as vLLM's linear methods re-make parameters, reads the same)."""
    old = b.data
    return (now.data_ptr(), now.shape, now.stride(), now.dtype) != (
        old.data_ptr(),
        old.shape,
        old.stride(),
        old.dtype,
    )


@torch.no_grad()
def keep_in_place(model: torch.nn.Module, before: Bindings) -> list[str]:
    """Put every tensor the refit rebound back into the storage it had, with its new values;
    returns the names put back. Raises RefitError naming those whose layout changed (shape,
    dtype or strides: a captured graph cannot read them where they were)."""
    kept, changed = [], []
    for mname, per in before.items():
        module = model.get_submodule(mname)
        now = tensor_items(module)
        for n, b in per.items():
            cur = now.get(n, (None, None))[1]
            if cur is None or b.data.is_meta or not _moved(b, cur):
                continue
            full = f"{mname}.{n}" if mname else n
            old = b.data
            if (cur.shape, cur.dtype, cur.stride()) != (old.shape, old.dtype, old.stride()):
                changed.append(
                    f"{full}: {tuple(old.shape)} {old.dtype} stride {old.stride()} -> "
                    f"{tuple(cur.shape)} {cur.dtype} stride {cur.stride()}"
                )
                continue
            old.copy_(cur)
            b.obj.data = old
            rebind(module, n, b.kind, b.obj)
            kept.append(full)
    if changed:
        raise RefitError(
            "refit refused: it rebound tensors that vLLM's captured CUDA graphs read, to other "
            "layouts, so the graphs would go on reading the old ones:\n  - "
            + "\n  - ".join(changed)
            + "\nrun the rollout engine without CUDA graphs "
            "(policy.generation.vllm_cfg.enforce_eager: true)"
        )
    return kept
