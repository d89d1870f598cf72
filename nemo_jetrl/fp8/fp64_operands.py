"""The float64 copy of a CPU FP8 weight that the exact GEMM reads, made once per weight version.

`gemm.blockwise_matmul(exact=True)` computes each 128-wide tile's dot product in float64, so
it needs its operands as float64. For the weight operand (the 128x128-blocked one: ``W`` in
FProp, ``W.T`` in DGrad) that copy is a pure function of the FP8 bits, and converting FP8 to
float64 costs ~2.6 ns per element on CPU: ~55% of a 32-row decode GEMM, paid again on every call
although the weight changes only at a refit or an optimizer step. `fp64_of` keeps it instead.

What it holds: per FP8 tensor family (a tensor and its views, e.g. ``W`` and the ``W.T`` view
that DGrad reads, share one entry), the float64 copy of the family's whole storage, 8 bytes per
FP8 element, CPU only (the GPU exact path converts per call, as before). It lives exactly as
long as the FP8 tensor it was made from (a weak reference: the entry goes with the tensor).

When it is remade: the key is the storage (identity and size), the FP8 dtype and the tensor's
version counter, which every in-place write through the tensor or any of its views bumps
(``copy_`` at a refit or ``load_state_dict``, ``Fp8InferenceLinear.commit``; `Fp8BlockLinear`'s
FP8 weight is a new tensor per master-weight version, `weight_cache`). Not seen, as in
`weight_cache`: writes through ``t.data`` (a new version counter) or from outside torch ops;
after such a write call `clear_fp64_operands`. Never cached: tensors without a version counter
(inference-mode tensors), tensor subclasses, code being traced by ``torch.compile``.

Bits: the returned tensor has the same values and the same strides as ``t.double()`` (a view of
the copy where ``t`` is dense; a contiguous copy of that view where ``t.double()`` would be
contiguous too), so every matmul reads the same layout as before and gives the same bits.
"""

from __future__ import annotations

import os
import weakref

import torch

# id(root tensor) -> (weak reference to it, key, float64 copy of its whole storage)
_ENTRIES: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}
_STATS = {"made": 0, "reused": 0}
_TABLES: dict[torch.dtype, torch.Tensor] = {}  # FP8 dtype -> float64 of its 256 codes
# At most this many bytes of float64 copies are held (8 per FP8 weight element: a 0.6B-parameter
# model run exact on CPU, trainer and rollout, would hold ~9.6 GB); past it a weight converts per
# call as before (same bits). JETRL_FP64_OPERAND_BYTES sets it; 0 turns the cache off.
_BUDGET_ENV = "JETRL_FP64_OPERAND_BYTES"
_DEFAULT_BUDGET = 2 << 30


def _budget() -> int:
    raw = os.environ.get(_BUDGET_ENV)
    if raw is None:
        return _DEFAULT_BUDGET
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(
            f"{_BUDGET_ENV}={raw!r}: give a byte count (0 turns the cache off)"
        ) from None


def fp8_to_fp64(t: torch.Tensor) -> torch.Tensor:
    """``t.double()``, bit for bit: a contiguous 1-byte float tensor on CPU (FP8) goes through a
    256-entry table (the table is ``.double()`` of every code, NaN codes included: tested), ~2.5x
    faster than torch's cast; anything else is ``t.double()``."""
    if t.device.type != "cpu" or t.element_size() != 1 or not t.is_contiguous():
        return t.double()
    table = _TABLES.get(t.dtype)
    if table is None:
        with torch.inference_mode(False):
            table = torch.arange(256, dtype=torch.uint8).view(t.dtype).double()
        _TABLES[t.dtype] = table
    return torch.take(table, t.view(torch.uint8).long())


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _key(t: torch.Tensor, root: torch.Tensor) -> tuple | None:
    """What must be unchanged for a cached copy to hold (None: never cache ``t``)."""
    if type(root) not in (torch.Tensor, torch.nn.Parameter) or type(t) is not type(root):
        return None
    if t.device.type != "cpu" or t.dim() != 2 or torch.compiler.is_compiling():
        return None
    try:
        version = root._version
        storage = root.untyped_storage()
    except (RuntimeError, NotImplementedError):  # inference tensors, storage-less tensors
        return None
    if storage.nbytes() != root.numel() * root.element_size():
        return None  # a root that does not own its whole storage (as_strided, set_): never
    return storage._cdata, storage.nbytes(), version, t.dtype


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t.double()`` keeps ``t``'s strides (a dense 2-D tensor: ``t`` or ``t.T``
    contiguous); otherwise it returns a contiguous tensor."""
    return t.is_contiguous() or t.t().is_contiguous()


def fp64_of(t: torch.Tensor) -> torch.Tensor:
    """``t.double()`` for a 2-D FP8 weight on CPU, from a float64 copy of its storage made once
    per version of ``t`` (see the module docstring); any other tensor: ``t.double()``."""
    root = _root(t)
    key = _key(t, root)
    if key is None:
        return t.double()
    entry = _ENTRIES.get(id(root))
    if entry is not None and entry[0]() is root and entry[1] == key:
        full = entry[2]
        _STATS["reused"] += 1
    else:
        n = key[1] // t.element_size()
        if _held_bytes() + 8 * n > _budget():
            return t.double()  # over the budget: this weight converts per call (same bits)
        with torch.inference_mode(False), torch.no_grad():
            full = fp8_to_fp64(t.as_strided((n,), (1,), 0))  # the whole storage
        i = id(root)
        ref = weakref.ref(root, lambda r: _drop(i, r))
        _ENTRIES[i] = (ref, key, full)
        _STATS["made"] += 1
    view = full.as_strided(t.shape, t.stride(), t.storage_offset())
    return view if _dense(t) else view.contiguous()


def _drop(i: int, ref: weakref.ref) -> None:
    """The weak reference's callback: the FP8 tensor is gone, so is its copy."""
    entry = _ENTRIES.get(i)
    if entry is not None and entry[0] is ref:
        del _ENTRIES[i]


def _held_bytes() -> int:
    return 8 * sum(e[2].numel() for e in _ENTRIES.values())


def clear_fp64_operands() -> int:
    """Drop every cached float64 copy (after writing FP8 weights through ``.data``); returns
    how many were dropped."""
    n = len(_ENTRIES)
    _ENTRIES.clear()
    return n


def fp64_operand_stats() -> dict[str, int]:
    """Copies made and reused since the process started, and how many are held now (bytes
    included: 8 per FP8 element of each held storage)."""
    return {**_STATS, "held": len(_ENTRIES), "bytes": _held_bytes(), "budget": _budget()}
