"""Which implementation the invariant ops run: the elementwise torch path or the Triton kernels.

The one place `ops` asks. Choices:

- ``"auto"`` (default): the Triton kernels (`nemo_jetrl.invariant.kernels`) for CUDA tensors when
  triton imports, the elementwise torch path otherwise (CPU: unchanged);
- ``"torch"``: the elementwise torch path everywhere (correct on CUDA, slow past toy sizes);
- ``"triton"``: the kernels for every tensor: CUDA, or CPU under ``TRITON_INTERPRET=1`` (tests);
  a tensor they cannot run on is refused by name.

Set it with `set_kernels` / `use_kernels`, or ``JETRL_INVARIANT_KERNELS`` in the environment
(read when no choice was set in code). Both sides of an RL step must use the same choice: the two
paths give a token different bits (each is batch-invariant on its own).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from nemo_jetrl.fp8.triton_launch import interpreting, triton_available

KERNELS_ENV = "JETRL_INVARIANT_KERNELS"
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What the kernels take; ``auto`` sends other dtypes (float64) to the torch path."""
CHOICES = ("auto", "torch", "triton")
_choice: str | None = None


def _checked(choice: str, where: str) -> str:
    if choice not in CHOICES:
        raise ValueError(f"{where}: {choice!r} is not one of {CHOICES}")
    return choice


def kernels() -> str:
    """The current choice: set in code, else ``JETRL_INVARIANT_KERNELS``, else ``"auto"``."""
    if _choice is not None:
        return _choice
    return _checked(os.environ.get(KERNELS_ENV, "auto") or "auto", KERNELS_ENV)


def set_kernels(choice: str | None) -> None:
    """Set the choice for this process (None: back to the environment / ``"auto"``)."""
    global _choice
    _choice = None if choice is None else _checked(choice, "set_kernels")


@contextmanager
def use_kernels(choice: str) -> Iterator[None]:
    """`set_kernels` for a ``with`` block, restoring the previous choice after it."""
    global _choice
    previous = _choice
    set_kernels(choice)
    try:
        yield
    finally:
        _choice = previous


def use_triton(x: torch.Tensor, label: str) -> bool:
    """Whether ``label``'s op runs its Triton kernel on ``x``."""
    choice = kernels()
    if choice == "torch":
        return False
    if choice == "auto":
        return x.is_cuda and x.dtype in KERNEL_DTYPES and triton_available()
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{label}: the invariant kernels take {KERNEL_DTYPES}, not {x.dtype}")
    if not triton_available():
        raise ValueError(
            f"{label}: invariant kernels 'triton' need triton (pip install 'nemo-jetrl[triton]'); "
            f"set {KERNELS_ENV}=torch or set_kernels('torch') for the elementwise path"
        )
    if not (x.is_cuda or interpreting()):
        raise ValueError(
            f"{label}: invariant kernels 'triton' on a {x.device.type} tensor need "
            f"TRITON_INTERPRET=1 (or a CUDA tensor); use 'auto' or 'torch' here"
        )
    return True
