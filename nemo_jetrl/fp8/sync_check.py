"""Detect host reads of tensor values (device syncs on CUDA) on any device, CPU included.

``torch.cuda.set_sync_debug_mode`` only sees CUDA tensors. `no_host_reads()` instead watches
what runs inside it at two levels and raises `HostReadError` on anything that hands a tensor's
values to Python, copies them to the host, or makes an output shape depend on them:

* Python-level calls (a torch-function mode; on a CPU tensor most of these dispatch no aten op
  at all): ``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")`` (or ``.to`` a
  CPU device from a non-CPU tensor), ``bool()``/``int()``/``float()``/``index()``/``complex()``
  of a tensor, ``torch.where(cond)`` with one argument.
* aten ops (a dispatch mode): ``_local_scalar_dense``/``is_nonzero``/``item``/``equal``/``allclose``,
  ``nonzero``/``argwhere``, ``masked_select``, ``unique`` (all overloads), ``bincount``,
  boolean-mask indexing (``index``/``index_put_`` with a bool or uint8 index tensor: the mask
  becomes indices through ``nonzero``), ``repeat_interleave`` with tensor repeats and no
  ``output_size``, and device-to-host ``_to_copy``/``copy_``.

Code that passes on CPU tensors therefore runs the same ops without a sync on CUDA and can be
captured in a CUDA graph. Not caught: ``.to(x.device)`` where ``x`` happens to be on the CPU
(indistinguishable on a CPU-only run from a same-device move) and reads made below the
dispatcher (C++ kernels, Triton launches); on a GPU use ``torch.cuda.set_sync_debug_mode``
too (the `gpu` tests do).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_HOST_READ_OPS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::is_nonzero",
        "aten::item",
        "aten::equal",
        "aten::allclose",
        "aten::nonzero",
        "aten::nonzero_numpy",
        "aten::argwhere",
        "aten::masked_select",
        "aten::unique",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::unique_dim_consecutive",
        "aten::bincount",
    }
)
_INDEX_OPS = frozenset(
    {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
)
_MASK_DTYPES = (torch.bool, torch.uint8)
# Python-level Tensor methods that always give values to the host.
_HOST_METHODS = frozenset(
    {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}
    | {"__complex__"}
)


class HostReadError(RuntimeError):
    """An op that reads tensor values on the host ran inside `no_host_reads`."""


def _is_cpu(device: Any) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "cpu"
    return isinstance(device, torch.device) and device.type == "cpu"


def _to_problem(args: tuple, kwargs: dict) -> str | None:
    """``Tensor.to(...)`` towards the host: a literal "cpu", or a CPU target from another device."""
    src = args[0]
    targets = [*args[1:], kwargs.get("device")]
    for t in targets:
        if isinstance(t, str) and _is_cpu(t):
            return 'Tensor.to("cpu")'
        on_cpu = _is_cpu(t) or (isinstance(t, torch.Tensor) and t.device.type == "cpu")
        if on_cpu and src.device.type != "cpu":
            return "Tensor.to(<cpu>) from a device tensor"
    return None


def _function_problem(func: Any, args: tuple, kwargs: dict) -> str | None:
    name = getattr(func, "__name__", "")
    tensor_self = bool(args) and isinstance(args[0], torch.Tensor)
    if tensor_self and name in _HOST_METHODS:
        return f"Tensor.{name}()"
    if tensor_self and name == "to":
        return _to_problem(args, kwargs)
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "torch.where(condition) with one argument (nonzero)"
    return None


def _dispatch_problem(func: Any, args: tuple, kwargs: dict) -> str | None:
    name = func._schema.name
    if name in _HOST_READ_OPS:
        return name
    masks = name in _INDEX_OPS and len(args) > 1
    if masks and any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in args[1]):
        return f"{name} with a boolean mask (the mask becomes indices through nonzero)"
    # self_int repeats are host ints (no Tensor overload reaches the dispatcher)
    tensor_repeats = func._overloadname in ("Tensor", "self_Tensor")
    if name == "aten::repeat_interleave" and tensor_repeats and kwargs.get("output_size") is None:
        return f"{name} with tensor repeats and no output_size"
    if name == "aten::_to_copy" and _is_cpu(kwargs.get("device")) and args[0].device.type != "cpu":
        return "device-to-host _to_copy"
    if name == "aten::copy_" and args[0].device.type == "cpu" and args[1].device.type != "cpu":
        return "device-to-host copy_"
    return None


def _raise(what: str) -> None:
    raise HostReadError(
        f"{what} reads tensor values on the host (a device sync on CUDA; not allowed while a "
        "CUDA graph is captured)"
    )


class _FunctionWatch(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        what = _function_problem(func, args, kwargs)
        if what is not None:
            _raise(what)
        return func(*args, **kwargs)


class no_host_reads(TorchDispatchMode):
    """Context manager: raise `HostReadError` on anything listed in the module docstring.

    ``ops_seen`` counts the aten ops dispatched inside it (a test can assert work happened)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops_seen = 0
        self._functions = _FunctionWatch()

    def __enter__(self) -> no_host_reads:
        self._functions.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._functions.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type, exc, tb) -> None:  # type: ignore[no-untyped-def]
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self._functions.__exit__(exc_type, exc, tb)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops_seen += 1
        kwargs = kwargs or {}
        what = _dispatch_problem(func, args, kwargs)
        if what is not None:
            _raise(what)
        return func(*args, **kwargs)


__all__ = ["HostReadError", "no_host_reads"]
