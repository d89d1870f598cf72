"""Launch/allocation inventory of code run on CPU tensors as the CUDA path runs it (tests only).

`Inventory` is a ``TorchDispatchMode`` that records every aten op, plus every Triton kernel
launch made through `triton_kernels._kernels()` (wrapped by `record_triton`: the launch runs
with the mode paused, so the interpreter's own tensor work is not counted) and every GEMM
handed to a runner (`fake_gemm_runner`: a labelled fake standing in for the GPU GEMM kernel,
one launch, output allocated empty).

Ops are sorted into: ``meta`` (views and metadata: no kernel, no memory), ``alloc`` (``empty*``:
memory, no kernel) and ``launch`` (everything else: on a GPU each is one kernel launch, e.g. a
``zeros`` fill, a ``copy_``, an ``isnan``/``any`` flag kernel, a ``_to_copy`` cast).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

META_OPS = frozenset(
    [
        "view",
        "_unsafe_view",
        "reshape",
        "_reshape_alias",
        "t",
        "transpose",
        "detach",
        "alias",
        "as_strided",
        "expand",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "permute",
        "lift_fresh",
        "numpy_T",
        "unbind",
        "split",
    ]
)
ALLOC_OPS = frozenset(["empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"])


class Inventory(TorchDispatchMode):
    """Records aten ops by name (``triton:<kernel>`` / ``gemm:<backend>`` for launches)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def kind(self, op: str) -> str:
        if op in META_OPS:
            return "meta"
        if op in ALLOC_OPS:
            return "alloc"
        return "launch"

    def count(self, kind: str) -> int:
        return sum(1 for op in self.ops if self.kind(op) == kind)

    def launches(self) -> list[str]:
        """The recorded ops that are kernel launches, in order."""
        return [op for op in self.ops if self.kind(op) == "launch"]

    def table(self) -> str:
        """``op xN`` per op, launches first (for assertion messages)."""
        c = Counter(self.ops)
        order = sorted(c, key=lambda op: (self.kind(op) != "launch", op))
        return ", ".join(f"{op} x{c[op]} ({self.kind(op)})" for op in order)


class _Launcher:
    def __init__(self, inv: Inventory, name: str, kernel) -> None:  # type: ignore[no-untyped-def]
        self.inv, self.name, self.kernel = inv, name, kernel

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        def launch(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.inv.ops.append(f"triton:{self.name}")
            with _disable_current_modes():
                return self.kernel[grid](*args, **kwargs)

        return launch


class _KernelModule:
    def __init__(self, inv: Inventory, module) -> None:  # type: ignore[no-untyped-def]
        self._inv, self._module = inv, module

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        value = getattr(self._module, name)
        return _Launcher(self._inv, name, value) if name.endswith("_kernel") else value


def record_triton(monkeypatch, inv: Inventory) -> None:  # type: ignore[no-untyped-def]
    """Route the quantizer's Triton launches through ``inv`` (one ``triton:<kernel>`` each)."""
    from nemo_jetrl.fp8 import triton_kernels

    module = triton_kernels._kernels()
    monkeypatch.setattr(triton_kernels, "_kernels", lambda: _KernelModule(inv, module))


def fake_gemm_runner(inv: Inventory, backend: str):  # type: ignore[no-untyped-def]
    """A stand-in for a GPU GEMM kernel (labelled fake: cuBLASLt/DeepGEMM cannot run here):
    records ``gemm:<backend>`` and returns an uninitialised output of the right shape."""

    def run(a, b, out_dtype):  # type: ignore[no-untyped-def]
        inv.ops.append(f"gemm:{backend}")
        with _disable_current_modes():
            return torch.zeros(a.data.shape[0], b.data.shape[0], dtype=out_dtype)

    return run
