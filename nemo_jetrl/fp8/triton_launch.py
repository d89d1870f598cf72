"""Where the Triton quantizers can run and how each launch is configured (`triton_kernels`,
`rowcol_quantize`): the interpreter switch, the FTZ launch option, the hardware-cast choice, the
``nonfinite_flag`` argument. Imports torch only (triton lazily, through `_deps`).
"""

from __future__ import annotations

import functools
import os
import struct

import torch

from nemo_jetrl.fp8._deps import available
from nemo_jetrl.fp8.quantize import INPUT_DTYPES

# Passed to every launch. Triton's default (enable_reflect_ftz=True) makes libdevice's div_rn /
# sqrt_rn flush subnormals (div.rn.ftz.f32): 1/scale for amax < ~5e-36 would store +0 where the
# reference stores a subnormal scale_inv (2.9e-39). The interpreter ignores the option (it never
# flushes), so a test checks that every launch passes it.
NO_FTZ = {"enable_reflect_ftz": False}
ENV_NATIVE_CAST = "JETRL_FP8_NATIVE_CAST"


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_available() -> bool:
    """True when triton imports (never raises; tried once per process, not on every call)."""
    return available("triton")


def can_run(x: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``x``: CUDA tensor, or CPU tensor under the interpreter."""
    if x.dtype not in INPUT_DTYPES or not triton_available():
        return False
    return x.is_cuda or (x.device.type == "cpu" and interpreting())


@functools.cache
def _native_cast_on(device_index: int) -> bool:
    """Hardware FP8 cast on this GPU: SM89+ (FP8 cvt) unless ``JETRL_FP8_NATIVE_CAST=0``.

    Read once per process and device (no environment read or device query per call)."""
    value = os.environ.get(ENV_NATIVE_CAST, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {ENV_NATIVE_CAST} is {value!r}; use 0 or 1")
    return value == "1" and torch.cuda.get_device_capability(device_index) >= (8, 9)


def resolve_native_cast(x: torch.Tensor, native_cast: bool | None) -> bool:
    """``native_cast=None``: the hardware cast for CUDA tensors on SM89+ (compiled kernels),
    the integer encode under the interpreter; True/False force one (True needs a GPU for bits)."""
    if native_cast is not None:
        return bool(native_cast)
    if not x.is_cuda or interpreting():
        return False
    return _native_cast_on(x.device.index if x.device.index is not None else 0)


def _flag_arg(flag: torch.Tensor | None, x: torch.Tensor, label: str) -> dict:
    """Launch arguments for ``nonfinite_flag`` (any pointer stands in when there is none)."""
    if flag is None:
        return {"FLAG": False}
    if flag.dtype != torch.int32 or flag.numel() < 1 or flag.device != x.device:
        raise ValueError(
            f"{label}: nonfinite_flag must be an int32 tensor on {x.device} (finite_flags.flag), "
            f"got {flag.dtype} {tuple(flag.shape)} on {flag.device}"
        )
    return {"FLAG": True}


def _fp32(v: float) -> float:
    """``v`` rounded to fp32 (RNE, as torch rounds a Python scalar against an fp32 tensor).

    Plain Python (no tensor), so the launch path holds no host read of any tensor."""
    return struct.unpack("f", struct.pack("f", v))[0]


def _bits_if_bf16(t: torch.Tensor) -> torch.Tensor:
    """bf16 is handed to the kernels as its int16 bit pattern (see ``to_fp32``)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _check_device(x: torch.Tensor, label: str) -> None:
    if x.device.type == "cpu" and not interpreting():
        raise RuntimeError(
            f"{label}: the Triton kernels need a CUDA tensor (got a CPU tensor); use "
            "nemo_jetrl.fp8.quantize_blockwise on CPU, or set TRITON_INTERPRET=1 before "
            "importing triton to run them in Triton's CPU interpreter"
        )
