"""A training weight's FP8 copy, quantized once per weight version (`Fp8BlockLinear`).

TE caches a linear's FP8 weight across micro-batches when the caller says "not the first
micro-batch". Here nobody has to say it: the copy is keyed on what changes whenever the weight
does, so a step reuses it exactly as long as the master weight's values cannot have changed:

* the tensor object (a weak reference: a replaced ``Parameter`` misses);
* its storage (a weak reference to the ``StorageImpl``, which keeps its address from being
  reused: ``w.data = ...``, ``.to(device/dtype)``, ``load_state_dict(assign=True)`` miss);
* its version counter ``w._version``, which every in-place op through the tensor bumps (an
  optimizer step, ``with torch.no_grad(): w.copy_(...)``, ``load_state_dict``);
* storage offset, shape, strides, dtype, device;
* the count of ``torch.optim`` optimizer steps taken in this process: fused optimizers
  (``AdamW(fused=True)``, measured on torch 2.13) update parameters without bumping
  ``_version``. The first cached quantization registers one process-wide, count-only
  ``register_optimizer_step_post_hook`` (every ``torch.optim.Optimizer`` subclass's ``step``
  runs it, apex/TE fused optimizers and the torch optimizer inside Megatron's included).

Not seen: writes through ``w.data`` (``w.data.copy_(...)``: ``.data`` is a new tensor with its
own version counter, the same hole autograd's saved-tensor check has) and kernels that write
parameters outside any tensor op and outside an optimizer's ``step`` (a raw
``torch._fused_adamw_`` or ``multi_tensor_applier`` call). Megatron's fp16 optimizer copies main
params through ``.data`` inside its ``step``, after its torch optimizer stepped: counted. After
any other such write call `invalidate_weight_caches` (or build the layer with
``cache_weight=False``). Tensors without a
version counter (inference-mode tensors), tensor subclasses (DTensor, fake tensors) and code
being traced by ``torch.compile`` are never cached.

The cached tensors come from a quantizer running under autograd's forward (no grad mode), so
they carry no graph; the cache holds nothing of the activations. A copy/pickle of the layer
starts with an empty cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from nemo_jetrl.fp8.quantize import BlockQuantized

_OPTIMIZER_STEPS = [0]  # torch.optim steps seen by the hook (a list: mutated in place)
_HOOK: list = []  # the hook's removable handle, once registered


def _count_optimizer_step(optimizer, args, kwargs) -> None:  # type: ignore[no-untyped-def]
    _OPTIMIZER_STEPS[0] += 1


def _watch_optimizer_steps() -> None:
    """Register the count-only optimizer step hook (once per process)."""
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_count_optimizer_step))


def _key(w: torch.Tensor) -> tuple | None:
    """What must be unchanged for a cached quantization of ``w`` to hold (None: never cache)."""
    if type(w) not in (torch.Tensor, torch.nn.Parameter) or torch.compiler.is_compiling():
        return None
    try:
        version = w._version
        storage = w.untyped_storage()
    except (RuntimeError, NotImplementedError):  # inference tensors, storage-less tensors
        return None
    shape = (w.storage_offset(), tuple(w.shape), w.stride(), w.dtype, w.device)
    return storage._cdata, version, _OPTIMIZER_STEPS[0], shape


class WeightCache:
    """The FP8 ``(W, W.T)`` of one weight version; ``quantizations`` counts misses filled."""

    def __init__(self) -> None:
        self.quantizations = 0
        self.clear()

    def clear(self) -> None:
        """Forget the cached copy (the next lookup misses)."""
        self._key: tuple | None = None
        self._tensor: weakref.ref | None = None
        self._storage: StorageWeakRef | None = None
        self.qw: BlockQuantized | None = None
        self.qwt: BlockQuantized | None = None

    def lookup(self, w: torch.Tensor, pair: bool) -> tuple[BlockQuantized, BlockQuantized] | None:
        """The cached ``(qw, qwt)`` if it was made from ``w`` as it is now (``qwt`` may be None
        unless ``pair``: DGrad needs it)."""
        if self.qw is None or (pair and self.qwt is None) or self._tensor is None:
            return None
        # No separate expired() check of the stored storage: the key holds its address, which
        # ``_storage`` keeps from being reused, and ``w``'s storage is alive, so an equal key
        # means the same live storage.
        if self._tensor() is not w or self._key != _key(w):
            return None
        return self.qw, self.qwt  # type: ignore[return-value]

    def store(self, w: torch.Tensor, qw: BlockQuantized, qwt: BlockQuantized | None) -> None:
        """Keep ``(qw, qwt)``, quantized from ``w`` as it is now (uncacheable ``w``: nothing)."""
        self.quantizations += 1
        _watch_optimizer_steps()
        key = _key(w)
        if key is None:
            self.clear()
            return
        self._key, self._tensor = key, weakref.ref(w)
        self._storage = StorageWeakRef(w.untyped_storage())
        self.qw, self.qwt = qw, qwt

    def __deepcopy__(self, memo: dict) -> WeightCache:
        return WeightCache()  # a copied layer has copied (new) storage: nothing carries over

    def __getstate__(self) -> dict:
        return {"quantizations": 0}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]


def invalidate_weight_caches(modules: torch.nn.Module | Iterable[torch.nn.Module]) -> int:
    """Drop the cached FP8 weights of every FP8 layer in ``modules`` (e.g. after writing master
    weights through ``.data``, which no version counter sees); returns how many were dropped."""
    roots = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
    n = 0
    for root in roots:
        for m in root.modules():
            cache = getattr(m, "fp8_weight_cache", None)
            if isinstance(cache, WeightCache):
                cache.clear()
                n += 1
    return n
