"""Rollback of a running engine's model: its whole state saved before a refit, put back if the
refit fails after the first tensor reached the engine.

Every refit path validates what it can before sending anything (``refit.py``), but some
failures only show once tensors are in the engine: a streamed NeMo-RL refit is refused in batch
k after batches 1..k-1 were loaded, vLLM's loader raises half way, the parity check finds a
difference. "A refused refit changes nothing" then needs the previous state back.

What "the state" is: what weight loading can write. For every module of the model, its
parameters, buffers and tensor attributes (values, *and* which tensor object and storage each
name was bound to: scales, their host copies) and its other attributes (the GEMM closures vLLM's
CPU build keeps with packed weight copies, the host floats attention hands its kernels, flags).
A snapshot clones the tensors and keeps references to the rest.

Never the KV cache (`KvCache`): vLLM binds each attention layer's cache as a plain tensor
attribute, ``kv_cache``, hundreds of times the weights' bytes, and in a colocated refit (sleep
mode level 1) its memory is unmapped, so reading it is an illegal access. It is recognised
without reading it: the ``kv_cache`` attribute of any module, the tensor objects the model
runner lists (``compat.kv_cache_tensors``) and any tensor sharing their storage. Snapshot,
restore and the check skip it (a refit never rebinds it). `restore_snapshot` rebinds every name to its original object and storage, copies
the saved values back in place (CUDA graphs captured those storages), puts the other
attributes back, deletes attributes the failed refit added, then reads everything again and
compares it with the snapshot bit for bit: "restored" is checked, not assumed. Nothing is
recomputed, so it works alike for any tensor-parallel rank and any vLLM version.

Memory: one copy of the model's weights and the tensors derived from them (FP8 linears as FP8
bytes; measured on vLLM's CPU engine: 0.5x the BF16 checkpoint, docs/vllm_patch.md), on the
tensors' GPU when
that leaves `RESERVE_BYTES` free, else in host memory; in host memory always when the caller says
so (NeMo-RL with vLLM colocated: its trainer sizes its refit buffers from the free memory it read
before our copy, so a copy on the GPU could leave it too little). The copy lives only for the
refit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_jetrl.vllm_patch import compat
from nemo_jetrl.vllm_patch.refit_kv import ParityError, RefitError

# Free GPU memory a device-side snapshot must leave for the refit's own buffers.
RESERVE_BYTES = 2 << 30
# nn.Module's own bookkeeping (registries, hooks, children): parameters and buffers are read
# from their registries, the rest is never part of a layer's state.
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)


class RollbackError(RuntimeError):
    """The engine could not be put back to its state before the refit (restart the engine)."""


@dataclass
class _Saved:
    obj: torch.Tensor
    """The tensor object bound to the name at snapshot time (parameter identity)."""
    data: torch.Tensor
    """An alias of its storage then (a refit may rebind ``.data``)."""
    copy: torch.Tensor
    """Its values then."""


@dataclass
class _ModuleState:
    tensors: dict[str, _Saved] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    """Where each tensor name lives: "param", "buffer" or "attr"."""


@dataclass(frozen=True)
class KvCache:
    """The KV cache's tensors, known by object and storage address only (never read)."""

    ids: frozenset[int]
    storages: frozenset[int]
    nbytes: int
    """Bytes of the distinct storages (metadata: nothing is read)."""

    @classmethod
    def of(cls, model: torch.nn.Module, runner: Any = None) -> KvCache:
        tensors = {id(t): t for t in compat.kv_cache_tensors(model, runner)}
        storages = {}
        for t in tensors.values():
            if not t.is_meta:
                st = t.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        storages.pop(0, None)  # empty tensors have no storage: never match them
        return cls(frozenset(tensors), frozenset(storages), sum(storages.values()))

    def holds(self, name: str, t: torch.Tensor) -> bool:
        if name == compat.KV_CACHE_ATTR or id(t) in self.ids:
            return True
        return not t.is_meta and t.untyped_storage().data_ptr() in self.storages


NO_KV_CACHE = KvCache(frozenset(), frozenset(), 0)


@dataclass
class Snapshot:
    """The model's state before a refit (see the module docstring)."""

    modules: dict[str, _ModuleState]
    device: torch.device
    """Where the saved copies are (the model's GPU, or "cpu")."""
    nbytes: int
    kv: KvCache = NO_KV_CACHE
    """What was left alone (and is skipped by restore and its check)."""


@dataclass(frozen=True)
class RestoreReport:
    tensors: int
    """Tensors restored and compared bit for bit."""
    values: int
    """Other attributes put back."""
    removed: tuple[str, ...]
    """Attributes the failed refit had added (deleted)."""


def tensor_items(
    module: torch.nn.Module, kv: KvCache = NO_KV_CACHE
) -> dict[str, tuple[str, torch.Tensor]]:
    out = {n: ("param", p) for n, p in module._parameters.items() if p is not None}
    out.update({n: ("buffer", b) for n, b in module._buffers.items() if b is not None})
    for n, v in module.__dict__.items():
        if n not in _MODULE_INTERNALS and isinstance(v, torch.Tensor):
            out[n] = ("attr", v)
    return {n: item for n, item in out.items() if not kv.holds(n, item[1])}


def _plain_items(module: torch.nn.Module) -> dict[str, Any]:
    return {
        n: v
        for n, v in module.__dict__.items()
        if n not in _MODULE_INTERNALS
        and n != compat.KV_CACHE_ATTR  # a list/tuple of cache views: left as it is
        and not isinstance(v, torch.Tensor)
    }


def snapshot_device(nbytes: int, device: torch.device, *, host: bool = False) -> torch.device:
    """Where a snapshot of ``nbytes`` of tensors living on ``device`` is kept (``host``: in host
    memory whatever is free)."""
    if device.type == "cuda" and not host:
        free, _ = torch.cuda.mem_get_info(device)
        if free >= nbytes + RESERVE_BYTES:
            return device
    return torch.device("cpu")


def model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cpu")


def take_snapshot(model: torch.nn.Module, runner: Any = None, *, host: bool = False) -> Snapshot:
    """Save ``model``'s state (module docstring): one copy of its tensors, the KV cache left
    alone (``runner``: the vLLM model runner, whose ``kv_caches`` are recognised too; ``host``:
    the copy in host memory even where the GPU has room, `snapshot_device`)."""
    kv = KvCache.of(model, runner)
    items = {name: tensor_items(m, kv) for name, m in model.named_modules()}
    seen: set[int] = set()
    nbytes = 0
    for per in items.values():
        for _, t in per.values():
            if id(t) not in seen and not t.is_meta:
                seen.add(id(t))
                nbytes += t.numel() * t.element_size()
    device = snapshot_device(nbytes, model_device(model), host=host)
    copies: dict[int, torch.Tensor] = {}  # a tied tensor is saved once
    modules: dict[str, _ModuleState] = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            state = _ModuleState(values=_plain_items(m))
            for n, (kind, t) in items[name].items():
                if id(t) not in copies:
                    copies[id(t)] = t if t.is_meta else t.detach().to(device, copy=True)
                state.tensors[n] = _Saved(t, t.data, copies[id(t)])
                state.kinds[n] = kind
            modules[name] = state
    return Snapshot(modules, device, nbytes, kv)


def rebind(module: torch.nn.Module, n: str, kind: str, obj: torch.Tensor) -> None:
    """Bind name ``n`` to ``obj`` where it was (parameter, buffer or plain attribute) and
    nowhere else."""
    homes = {"param": module._parameters, "buffer": module._buffers, "attr": module.__dict__}
    for home in homes.values():
        home.pop(n, None)
    homes[kind][n] = obj


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_meta or b.is_meta:
        return a.is_meta and b.is_meta
    a8 = a.detach().reshape(-1).contiguous().view(torch.uint8)
    b8 = b.detach().reshape(-1).contiguous().view(torch.uint8).to(a8.device)
    return torch.equal(a8, b8)


def _restore_module(module: torch.nn.Module, state: _ModuleState, kv: KvCache) -> list[str]:
    removed = []
    now = tensor_items(module, kv)
    for n in set(now) - set(state.tensors):
        kind = now[n][0]
        registry = {"param": module._parameters, "buffer": module._buffers}.get(kind)
        (registry if registry is not None else module.__dict__).pop(n, None)
        removed.append(n)
    for n in set(_plain_items(module)) - set(state.values):
        del module.__dict__[n]
        removed.append(n)
    with torch.no_grad():
        for n, saved in state.tensors.items():
            rebind(module, n, state.kinds[n], saved.obj)
            cur = saved.obj.data
            if (cur.data_ptr(), cur.shape, cur.dtype) != (
                saved.data.data_ptr(),
                saved.data.shape,
                saved.data.dtype,
            ):
                saved.obj.data = saved.data  # the refit rebound ``.data``: back to the storage
            if not saved.obj.is_meta:
                saved.data.copy_(saved.copy)
    for n, v in state.values.items():
        module.__dict__[n] = v
    return removed


def _differences(model: torch.nn.Module, snap: Snapshot) -> list[str]:
    out = []
    modules = dict(model.named_modules())
    for name, state in snap.modules.items():
        m = modules.get(name)
        if m is None:
            out.append(f"{name or '<model>'}: module gone")
            continue
        now = tensor_items(m, snap.kv)
        for n, saved in state.tensors.items():
            label = f"{name}.{n}" if name else n
            cur = now.get(n, (None, None))[1]
            if cur is not saved.obj:
                out.append(f"{label}: another tensor object is bound")
            elif cur.data_ptr() != saved.data.data_ptr():
                out.append(f"{label}: other storage")
            elif not _same_bytes(cur, saved.copy):
                out.append(f"{label}: values differ")
        plain = _plain_items(m)
        for n, v in state.values.items():
            if n not in plain or plain[n] is not v:
                out.append(f"{name}.{n}: attribute not restored")
    return out


def restore_snapshot(model: torch.nn.Module, snap: Snapshot) -> RestoreReport:
    """Put ``model`` back to ``snap`` and verify it bit for bit; RollbackError names what
    could not be restored."""
    modules = dict(model.named_modules())
    missing = sorted(set(snap.modules) - set(modules))
    removed: list[str] = []
    for name, state in snap.modules.items():
        if name in modules:
            removed += [f"{name}.{n}" for n in _restore_module(modules[name], state, snap.kv)]
    wrong = [f"{m}: module gone" for m in missing] or _differences(model, snap)
    if wrong:
        raise RollbackError(
            "rolling the engine back to its weights before the refit failed; its state is "
            "unknown, restart it (or resume from the last checkpoint):\n  - "
            + "\n  - ".join(wrong[:20])
            + (f"\n  - ... and {len(wrong) - 20} more" if len(wrong) > 20 else "")
        )
    return RestoreReport(
        tensors=sum(len(s.tensors) for s in snap.modules.values()),
        values=sum(len(s.values) for s in snap.modules.values()),
        removed=tuple(sorted(removed)),
    )


def rolled_back(exc: BaseException, tensors: int, where: str = "") -> Exception:
    """The error to raise for ``exc`` once the engine was restored: the same refusal, saying so
    (``where``: which ranks, for a rank of a tensor-parallel engine)."""
    note = (
        f"The engine was rolled back to its state before this refit ({tensors} tensors "
        f"restored and checked bit for bit{where}): it still holds the previous weights."
    )
    if isinstance(exc, (RefitError, ParityError)):
        return type(exc)(f"{exc}\n{note}")
    return RefitError(f"refit failed in the engine ({type(exc).__name__}: {exc}).\n{note}")


@contextmanager
def engine_rollback(llm: Any, enabled: bool = True) -> Iterator[None]:
    """Around the part of a refit that writes into ``llm``'s workers (a ``vllm.LLM`` whose
    worker extension is ours): each worker snapshots its model first; on an error every worker
    is restored and verified, and the error says so (`rolled_back`)."""
    if not enabled:
        yield
        return
    llm.collective_rpc("jetrl_snapshot")
    try:
        yield
    except Exception as exc:
        try:
            reports = llm.collective_rpc("jetrl_restore")
        except Exception as failed:
            raise RollbackError(f"{failed}\n(the refit had failed with: {exc})") from exc
        raise rolled_back(exc, sum(r["tensors"] for r in reports)) from exc
    else:
        llm.collective_rpc("jetrl_drop_snapshot")
