"""Where the Triton quantizers can run and how each launch is configured (`triton_kernels`,
`rowcol_quantize`): the interpreter switch, the FTZ launch option, the hardware-cast choice, the
``nonfinite_flag`` argument, the launch settings built once per setting (`launch_meta`), and
`launch`, which calls a compiled kernel's launcher directly after its first launch through
Triton (``JETRL_TRITON_DIRECT_LAUNCH=0`` turns that off; see the section comment above it).
Imports torch only (triton lazily, through `_deps`).
"""

from __future__ import annotations

import functools
import itertools
import os
import struct

import torch

from nemo_jetrl.fp8._deps import available, require
from nemo_jetrl.fp8.formats import Fp8Format, get_format
from nemo_jetrl.fp8.quantize import INPUT_DTYPES

# Passed to every launch. Triton's default (enable_reflect_ftz=True) makes libdevice's div_rn /
# sqrt_rn flush subnormals (div.rn.ftz.f32): 1/scale for amax < ~5e-36 would store +0 where the
# reference stores a subnormal scale_inv (2.9e-39). The interpreter ignores the option (it never
# flushes), so a test checks that every launch passes it.
NO_FTZ = {"enable_reflect_ftz": False}
# For kernels whose bits must follow their source op for op (the SiLU rule, the combine, the
# invariant attention): Triton's default (enable_fp_fusion=True) lets LLVM fuse a mul and an add
# into one fma and writes the rest without a rounding mode, which lets ptxas fuse them too, so
# where an fma lands depends on how the code was scheduled (the attention kernel gave other bits
# at 1 and 2 pipeline stages on an H200, GPU results run 7). Off, every fp32 add/sub/mul is
# emitted with ``.rn`` (nothing fuses them); the census checks the PTX. The interpreter ignores it.
NO_FMA = {"enable_fp_fusion": False}
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
    return x.is_cuda and native_cast_default(x.device.index or 0)


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


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (a persistent kernel's grid is a multiple)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


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


@functools.cache
def native_cast_default(device_index: int) -> bool:
    """`resolve_native_cast(x, None)` for a CUDA tensor on ``device_index``, decided once per
    process (Triton fixes interpreter-or-compiler when it defines a kernel, so the per-call
    environment read this replaces could never change the answer)."""
    return not interpreting() and _native_cast_on(device_index)


def format_constants(f: Fp8Format, input_dtype: torch.dtype, native_cast: bool) -> dict:
    """The quantizer kernels' format constexprs (``_triton_common.quantize_blocks``'s): fp8
    max, the input dtype's max, mantissa bits and bias, the cast, the FP8 type, bf16 input."""
    require("triton", feature="Triton FP8 kernels")
    import triton.language as tl

    mant, bias = (3, 7) if f.name == "e4m3" else (2, 15)
    return {
        "FMAX": float(f.fmax),
        "MAXV": float(torch.finfo(input_dtype).max),
        "MANT": mant,
        "BIAS": bias,
        "NATIVE": bool(native_cast),
        "FP8": tl.float8e4nv if f.name == "e4m3" else tl.float8e5,
        "IN_BF16": input_dtype == torch.bfloat16,
    }


@functools.cache
def launch_meta(
    fmt_name: str,
    input_dtype: torch.dtype,
    native: bool,
    eps: float,
    pow2: bool,
    flag: bool,
    num_warps: int,
    **constexprs: int | bool,
) -> dict:
    """The keyword arguments of a quantizer launch that depend only on its settings (format
    constants, scale rule, flag, options incl. `NO_FTZ`), built once per setting instead of per
    call. Shared: callers unpack it and never mutate it."""
    f = get_format(fmt_name)
    meta = LaunchMeta(
        EPS=_fp32(eps) if eps > 0 else 0.0,
        POW2=bool(pow2),
        num_warps=num_warps,
        FLAG=flag,
        **constexprs,
        **NO_FTZ,
        **format_constants(f, input_dtype, native),
    )
    meta.key = next(_META_KEYS)
    return meta


class LaunchMeta(dict):
    """`launch_meta`'s dict, with ``key``: a number no other LaunchMeta has, so a launch keys
    on it instead of hashing the items per call (Triton's dtypes hash in Python)."""

    key: int


_META_KEYS = itertools.count()


def frozen_meta(**meta: object) -> LaunchMeta:
    """A `launch` meta dict built once by its caller (constexprs and options by name), keyed by
    a number like `launch_meta`'s: for kernels other than the quantizers (the split-K GEMM)."""
    out = LaunchMeta(meta)
    out.key = next(_META_KEYS)
    return out


# ------------------------------------------------------------------------- direct launches
#
# ``kernel[grid](*args, **meta)`` runs Triton's ``JITFunction.run`` on every call: it reads
# knobs, binds and specialises every argument, builds a string cache key, checks the kernel's
# globals and builds launch metadata for the (empty) hook chain before it calls the compiled
# kernel's launcher (~0.1 ms per launch under cProfile on an H100, results/README.md run 6).
# `launch` makes the first call of each specialisation that way and keeps what it returned (the
# compiled kernel's launcher, function handle and packed metadata); later calls with the same
# specialisation call that launcher directly, with the arguments JITFunction.run passes it.
#
# What Triton specialises on, read in triton/runtime/jit.py and triton/backends/compiler.py of
# the versions in DIRECT_LAUNCH_TRITON: per tensor its dtype and data_ptr % 16; per int its
# value == 1, value % 16 and its i32/i64/u64 range; floats, bools and None by type; constexprs
# and options by value. `_spec` keys on exactly those, so two calls that share a key run the
# same compiled kernel under JITFunction.run too. Not repeated per direct call: the knob reads
# (TRITON_DEBUG etc. are fixed per key once seen) and the check that the kernel's module
# globals are unchanged (ours are constants).
#
# Explicit fallbacks to JITFunction.run: the interpreter; JETRL_TRITON_DIRECT_LAUNCH=0; a Triton
# outside DIRECT_LAUNCH_TRITON or whose compiled kernel lacks an attribute used here (warned once,
# `direct_launch_status` says why); a launch hook or pre-run hook set (checked per call: a
# profiler that hooks launches sees every launch); a kernel that is not a JITFunction (a test's
# spy).

ENV_DIRECT_LAUNCH = "JETRL_TRITON_DIRECT_LAUNCH"
# (major, minor) range whose JITFunction.run / CompiledKernel this was read against: 3.6 (the GPU
# image), 3.9 (the CPU image); the launch line is the same in both.
DIRECT_LAUNCH_TRITON = ((3, 6), (3, 9))
_I32 = (-(1 << 31), (1 << 31) - 1)
_DIRECT: dict = {"on": None, "why": "not decided yet (no launch so far)"}
_COMPILED: dict[tuple, tuple] = {}  # specialisation key -> (launcher, function, packed, tail)


def direct_launch_status() -> tuple[bool | None, str]:
    """(whether `launch` calls compiled launchers directly, why); None before the first launch."""
    return _DIRECT["on"], _DIRECT["why"]


def _decide() -> bool:
    """Decide once per process whether direct launches are on (see the section comment)."""
    import warnings

    import triton

    value = os.environ.get(ENV_DIRECT_LAUNCH, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {ENV_DIRECT_LAUNCH} is {value!r}; use 0 or 1")
    version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    lo, hi = DIRECT_LAUNCH_TRITON
    on, why = False, "direct launches on"
    if value == "0":
        why = f"{ENV_DIRECT_LAUNCH}=0"
    elif interpreting():
        why = "Triton's interpreter runs the kernels (TRITON_INTERPRET=1)"
    elif not lo <= version <= hi:
        why = f"Triton {triton.__version__} is outside the versions read {DIRECT_LAUNCH_TRITON}"
        warnings.warn(f"{why}: every launch goes through JITFunction.run", stacklevel=3)
    else:
        on = True
    try:  # what `launch` calls on a direct launch (a torch without CUDA has no stream getter)
        from triton import knobs
        from triton.runtime.jit import JITFunction

        device, stream = torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream
        _DIRECT.update(types=(JITFunction,), runtime=knobs.runtime, device=device, stream=stream)
    except (ImportError, AttributeError) as err:
        if on:
            why = f"Triton {triton.__version__} or torch lacks what direct launches use ({err!r})"
            warnings.warn(f"{why}: every launch goes through JITFunction.run", stacklevel=3)
        on = False
        _DIRECT["types"] = ()
    _DIRECT.update(on=on, why=why)
    return on


def _spec(kernel: object, device: int, grid: tuple, args: tuple, meta: dict) -> tuple:
    """What Triton specialises this launch on (see the section comment), as a dict key."""
    settings = meta.key if meta.__class__ is LaunchMeta else tuple(meta.items())
    spec: list = [id(kernel), device, len(grid), settings]
    for a in args:
        t = a.__class__
        if t is int:
            spec.append((a == 1, a % 16 == 0, _I32[0] <= a <= _I32[1], a >= 1 << 63))
        elif isinstance(a, torch.Tensor):  # Parameter and other subclasses included
            spec.append((a.dtype, a.data_ptr() % 16 == 0))
        else:  # float, bool, None: by type only, as Triton does
            spec.append(t)
    return tuple(spec)


def launch(kernel, grid: tuple[int, ...], args: tuple, meta: dict) -> None:  # type: ignore[no-untyped-def]
    """``kernel[grid](*args, **meta)``: the compiled kernel's launcher called directly once this
    specialisation was launched through Triton (see the section comment). ``args``: the
    kernel's leading parameters, positional; ``meta``: its remaining parameters (constexprs) and
    launch options, by name."""
    on = _DIRECT["on"]
    if on is None:
        on = _decide()
    if not on or kernel.__class__ not in _DIRECT["types"]:
        kernel[grid](*args, **meta)
        return
    rt = _DIRECT["runtime"]
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    hooked = (enter is not None and getattr(enter, "calls", True)) or (
        leave is not None and getattr(leave, "calls", True)
    )
    if hooked or kernel.pre_run_hooks:
        kernel[grid](*args, **meta)
        return
    device = _DIRECT["device"]()
    key = _spec(kernel, device, grid, args, meta)
    hit = _COMPILED.get(key)
    if hit is None:
        _first_launch(kernel, key, grid, args, meta)
        return
    run, function, packed, tail = hit
    g = (*grid, 1, 1)
    run(g[0], g[1], g[2], _DIRECT["stream"](device), function, packed, None, None, None,
        *args, *tail)  # fmt: skip


def _first_launch(kernel, key: tuple, grid: tuple, args: tuple, meta: dict) -> None:  # type: ignore[no-untyped-def]
    """Launch through JITFunction.run (compiles if needed) and keep its compiled kernel."""
    import warnings

    compiled = kernel[grid](*args, **meta)
    names = kernel.arg_names[len(args) :]
    try:
        entry = (compiled.run, compiled.function, compiled.packed_metadata)
        tail = tuple(meta[name] for name in names)
    except (AttributeError, KeyError) as err:
        why = f"Triton's compiled kernel or {kernel.__name__}'s parameters differ ({err!r})"
        _DIRECT.update(on=False, why=why)
        warnings.warn(f"{why}: every launch goes through JITFunction.run", stacklevel=3)
        return
    _COMPILED[key] = (*entry, tail)
