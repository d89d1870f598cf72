"""Detect host reads of tensor values (device syncs on CUDA) on any device, CPU included.

``torch.cuda.set_sync_debug_mode`` only sees CUDA tensors. `no_host_reads()` instead watches
every aten op dispatched inside it and raises `HostReadError` on the ops that hand a tensor's
value to Python or make a shape depend on values: ``.item()``/``float()``/``bool()``
(``aten._local_scalar_dense``, ``aten.is_nonzero``, ``aten.item``), ``aten.equal`` and
``aten.nonzero``/``masked_select``. Code that passes on CPU tensors therefore does not sync on
CUDA (the same ops run) and can be captured in a CUDA graph. Used by the tests of the serving
path (`vllm_patch.kernel`'s quantizer and GEMMs).
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

_HOST_READ_OPS = (
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "aten::item",
    "aten::equal",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique",
    "aten::_unique2",
)


class HostReadError(RuntimeError):
    """An op that reads tensor values on the host ran inside `no_host_reads`."""


class no_host_reads(TorchDispatchMode):
    """Context manager: raise `HostReadError` on any op listed in the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.ops_seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops_seen += 1
        name = func._schema.name
        if name in _HOST_READ_OPS:
            raise HostReadError(
                f"{name} reads a tensor value on the host (a device sync on CUDA; not allowed "
                "while a CUDA graph is captured)"
            )
        return func(*args, **(kwargs or {}))


__all__ = ["HostReadError", "no_host_reads"]
