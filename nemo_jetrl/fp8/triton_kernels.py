"""Triton kernels for blockwise FP8 quantization, bit-exact to `quantize_blockwise`.

The math is the spec in `nemo_jetrl.fp8.quantize`; this module only makes it one memory pass on a
GPU. Every step that could round differently from the torch reference is written so that it
cannot:

* amax is taken on the fp32 *bit patterns* with an integer max. For non-negative floats the
  integer order is the float order, and +inf/NaN patterns sort above every finite value, so a
  non-finite input always shows up in amax (a float ``max`` on GPU may silently drop NaN).
* ``scale = fmax / amax`` uses ``tl.math.div_rn`` (IEEE round-to-nearest). Triton's plain ``/``
  on fp32 lowers to an approximate division on NVIDIA GPUs and would change scales in the last
  bit; the interpreter cannot tell the two apart, so a test checks the kernel source instead.
  Every launch passes ``enable_reflect_ftz=False`` (`NO_FTZ`) so ``scale_inv = 1/scale`` keeps
  its subnormal values (amax below ~5e-36) instead of flushing them to zero.
* power-of-two scales keep only the sign and exponent bits of the fp32 scale (bit mask), which
  is exactly ``2**floor(log2(scale))``.
* the FP8 cast is done in integer arithmetic (round to nearest, ties to even, normal and
  subnormal ranges) after an explicit clamp to ``[-fmax, fmax]``: the reference encode, the same
  bits on every GPU generation and in Triton's CPU interpreter, whose own FP8/BF16 conversions
  do not round to nearest-even. On a GPU with FP8 (SM89+) the kernels use the hardware
  ``cvt.rn.satfinite`` instead (``native_cast=None``, the default: measured to give the same
  codes on every finite bf16 pattern, DESIGN.md "GPU facts"; `gpu` tests check it exhaustively).
  ``native_cast=False``, or ``JETRL_FP8_NATIVE_CAST=0`` (read once per process), keeps the
  integer encode on a GPU; under the interpreter it is always used.

A block with a non-finite value stores ``scale_inv = NaN`` (as the reference does with
``check_finite=False``), so even unchecked output can never look valid; by default the Python
wrappers check ``scale_inv`` and re-run the torch reference on the input, which raises the
reference's ValueError naming the tensor and block. ``check_finite=False`` skips that check: no
host read at all, so the launch can be captured in a CUDA graph (the vLLM serving path).
``nonfinite_flag`` (an int32 device tensor, `finite_flags.flag`) folds the sync-free check into
the kernel: it stores 1 there when any block was non-finite, no separate isnan/any kernels.

Layouts: by default the compact layout of `BlockQuantized` (``data`` in the input shape,
``scale_inv`` ``[ceil(M/bm), ceil(K/bk)]``). ``transpose=True`` (128x1 only) writes ``data`` as
``[K, M]`` and returns the transposed `BlockQuantized` (block 1x128 of the transpose), which is
TE's columnwise layout (what WGrad consumes). ``scale_layout="mn_major"`` writes ``scale_inv``
M-major with the M stride padded to a multiple of 4 (16 bytes): the TMA-aligned layout DeepGEMM's
SM90 kernels read without a copy (``layouts.deepgemm_sf_fp32``); its padded storage
(`mn_major_storage`) is TE's GEMM-ready 1x128 ``scale_inv``, and with ``transpose=True`` TE's
columnwise (128x1) ``scale_inv``, so TE's layouts are written directly too.

Triton is an optional dependency: it is imported inside functions only, so ``nemo_jetrl.fp8``
imports without it. On CPU the kernels run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from nemo_jetrl.fp8._deps import require
from nemo_jetrl.fp8.formats import Fp8Format, get_format
from nemo_jetrl.fp8.quantize import (
    Block,
    BlockQuantized,
    as_2d,
    check_block,
    quantize_reference,
)
from nemo_jetrl.fp8.triton_launch import ENV_NATIVE_CAST as ENV_NATIVE_CAST
from nemo_jetrl.fp8.triton_launch import NO_FTZ as NO_FTZ
from nemo_jetrl.fp8.triton_launch import (
    _bits_if_bf16,
    _check_device,
    _flag_arg,
    _fp32,
    launch,
    launch_meta,
)
from nemo_jetrl.fp8.triton_launch import _native_cast_on as _native_cast_on
from nemo_jetrl.fp8.triton_launch import can_run as can_run
from nemo_jetrl.fp8.triton_launch import format_constants as _format_constants
from nemo_jetrl.fp8.triton_launch import interpreting as interpreting
from nemo_jetrl.fp8.triton_launch import resolve_native_cast as resolve_native_cast
from nemo_jetrl.fp8.triton_launch import triton_available as triton_available

# Kernel "modes": which axes of a tile one scale covers.
_MODE = {(1, 128): 0, (128, 128): 1, (128, 1): 2}
SCALE_LAYOUTS = ("compact", "mn_major")


@functools.cache
def _kernels() -> ModuleType:
    """The module holding the jitted kernels; imports triton lazily (once)."""
    require("triton", feature="Triton FP8 quantization kernels")
    from nemo_jetrl.fp8 import _triton_jit

    return _triton_jit


def _scale_buffer(
    mb: int, kb: int, layout: str, device: torch.device, *, kernel_pads: bool = False
) -> torch.Tensor:
    """``[mb, kb]`` fp32 tensor in the requested layout (a strided view for ``mn_major``).

    ``kernel_pads``: the kernel writes the ``mn_major`` padding zeros itself (no fill kernel)."""
    if layout == "compact":
        return torch.empty(mb, kb, dtype=torch.float32, device=device)
    if layout == "mn_major":
        pad = -(-mb // 4) * 4
        # zero padding (as layouts.py writes it); the kernel fills the [kb, mb] part, which is
        # all of it at mb % 4 == 0 (a fill kernel there would write what the kernel overwrites)
        alloc = torch.empty if kernel_pads or pad == mb else torch.zeros
        return alloc(kb, pad, dtype=torch.float32, device=device)[:, :mb].t()
    raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {layout!r}")


def mn_major_storage(scale_inv: torch.Tensor) -> torch.Tensor:
    """The padded ``[kb, pad4(mb)]`` array an ``mn_major`` ``scale_inv`` view lives in.

    For a 1x128 quantization this is TE's GEMM-ready rowwise ``scale_inv``; for ``transpose=True``
    (128x1) it is TE's columnwise ``scale_inv`` (see `nemo_jetrl.fp8.layouts`).
    """
    mb, kb = scale_inv.shape
    pad = scale_inv.stride(1)
    if scale_inv.stride(0) != 1 or pad != -(-mb // 4) * 4:
        raise ValueError(
            f"mn_major_storage: expected strides (1, {-(-mb // 4) * 4}), got {scale_inv.stride()}"
        )
    return scale_inv.as_strided((kb, pad), (pad, 1))


def _raise_like_reference(x, block, f, pow2_scales, eps, name) -> None:
    # Delegate to the reference so the error (tensor name, index, block) is identical.
    quantize_reference(x.cpu(), block, fmt=f, pow2_scales=pow2_scales, eps=eps, name=name)
    raise RuntimeError(  # pragma: no cover - the reference found nothing wrong
        "Triton quantizer flagged a non-finite block but the reference accepted the input"
    )


@functools.cache
def _tile(mode: int) -> tuple[int, ...]:
    """(TM, TK, num_warps[, CHUNK, STAGES[, PACK]]) per mode; bigger tiles under the interpreter
    (fewer Python programs). CHUNK and STAGES (128x1 only; default TM and 1): the rows a program
    loads at a time and its pipeline depth (`_triton_jit._quantize_cols`); PACK (128x1 whole
    tiles, transposed output at M % 4 == 0; default False): four tokens' codes packed into a
    word before the transpose (`_triton_jit._quantize_cols_packed`). Decided once per process
    (Triton fixes interpreter-or-compiler when it defines a kernel). Speed only: no tile changes
    a bit (`bench_quantizer_bandwidth.py --sweep-tiles` times the candidates on a GPU and checks
    each one's bits). 128x1 on the H200 (run 8, 8192 x 4096): the whole (128, 64, 4) tile 58% of
    a bf16 copy's bandwidth (66% writing the trainer's transposed layout), 32-row chunks
    pipelined at 2 stages 34%, (128, 32, 4) 49%: whole tiles, programs walking along K."""
    if interpreting():
        return {0: (64, 128, 4), 1: (128, 128, 4), 2: (128, 128, 4)}[mode]
    return {0: (16, 128, 4), 1: (128, 128, 8), 2: (128, 64, 4)}[mode]


def _check_out(out, x2: torch.Tensor, f, label: str) -> None:
    """``out=(data, scale_inv)``: caller-given buffers for a 2-D 1x128 quantization, written in
    place (the vLLM serving kernel hands buffers in its GEMM's layout, so nothing is padded or
    transposed per call). ``data``: ``[R, K]`` FP8, R >= M, unit stride along K; ``scale_inv``:
    ``[R, ceil(K/128)]`` fp32, any strides. Rows M..R-1 are written as quantized zero rows (codes
    0, ``scale_inv`` 1): the zero padding a GEMM that takes rows in multiples needs."""
    m, k = x2.shape
    data, s = out
    r = data.shape[0] if data.dim() == 2 else -1
    if r < m or data.shape[-1] != k or data.dtype != f.dtype or (k > 1 and data.stride(-1) != 1):
        raise ValueError(
            f"{label}: out data must be an [R >= {m}, {k}] {f.dtype} tensor with unit stride "
            f"along K, got {tuple(data.shape)} {data.dtype} strides {data.stride()}"
        )
    want = (r, -(-k // 128))
    if tuple(s.shape) != want or s.dtype != torch.float32 or s.device != x2.device:
        raise ValueError(
            f"{label}: out scale_inv must be a {list(want)} float32 tensor on {x2.device}, "
            f"got {tuple(s.shape)} {s.dtype} on {s.device}"
        )


def quantize_blockwise_triton(
    x: torch.Tensor,
    block: Block,
    *,
    fmt: str | Fp8Format = "e4m3",
    pow2_scales: bool = True,
    eps: float = 0.0,
    name: str | None = None,
    check_finite: bool = True,
    transpose: bool = False,
    scale_layout: str = "compact",
    native_cast: bool | None = None,
    transposed_copy: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    nonfinite_flag: torch.Tensor | None = None,
) -> BlockQuantized:
    """`quantize_blockwise` in one Triton kernel: same arguments, same bits, same errors.

    ``check_finite=False`` skips the host-side check (a device sync; not allowed while a CUDA
    graph is captured): a non-finite block then shows as a non-finite ``scale_inv``.
    ``transpose`` (128x1 only) returns ``quantize_blockwise(x, (128, 1)).t()`` with contiguous
    ``[K, M]`` data (TE's columnwise layout). ``scale_layout`` is ``"compact"`` or
    ``"mn_major"`` (see the module docstring). ``transposed_copy`` (2-D input, no ``transpose``):
    a contiguous ``[K, M]`` FP8 tensor that receives the same codes transposed in the same pass
    (`quantize_with_transpose_triton`). ``native_cast``: see the module docstring.
    ``nonfinite_flag``: int32 device tensor set to 1 if a block is non-finite (`finite_flags`).
    """
    block = check_block(block)
    f = get_format(fmt)
    label = f"quantize_blockwise(tensor {name!r})" if name else "quantize_blockwise"
    x2 = as_2d(x, block, label)
    if not x.is_cuda:
        _check_device(x, label)
    if x.dim() != 2 and scale_layout != "compact":
        raise ValueError(f"{label}: scale_layout={scale_layout!r} needs 2-D input")
    if transpose and block != (128, 1):
        raise ValueError(f"{label}: transpose=True is only for block (128, 1), got {block}")
    m, k = x2.shape
    if nonfinite_flag is not None:
        _flag_arg(nonfinite_flag, x, label)
    if transposed_copy is not None:
        want = (k, m)
        if transpose or x.dim() != 2 or tuple(transposed_copy.shape) != want:
            raise ValueError(f"{label}: transposed_copy needs 2-D input and shape {want}")
        if transposed_copy.dtype != f.dtype or not transposed_copy.is_contiguous():
            raise ValueError(f"{label}: transposed_copy must be a contiguous {f.dtype} tensor")
    if out is not None:  # caller-given buffers (`_check_out`)
        if transpose or x.dim() != 2 or block != (1, 128):
            raise ValueError(f"{label}: out= is for 2-D 1x128 quantization only")
        _check_out(out, x2, f, label)
    bm, bk = block
    mb, kb = -(-m // bm), -(-k // bk)
    mode = _MODE[block]
    tm, tk, warps, *more = _tile(mode)
    chunk, stages, pack = (*more, *(tm, 1, False)[len(more) :])
    pack = bool(pack) and transpose and m % 4 == 0  # words of 4 tokens (`_quantize_cols_packed`)
    if transpose:
        data_t = torch.empty(k, m, dtype=f.dtype, device=x.device)
        q_u8 = data_t.view(torch.uint8)
        sqm, sqk = 1, max(m, 1)
        # scale_inv of the transposed result is [K, mb]; the kernel indexes it as [mb, K].
        scale_t = _scale_buffer(k, mb, scale_layout, x.device)
        s_view, ssm, ssk = scale_t, scale_t.stride(1), scale_t.stride(0)
    else:
        data = torch.empty(m, k, dtype=f.dtype, device=x.device) if out is None else out[0]
        q_u8 = data.view(torch.uint8)
        sqm, sqk = (max(k, 1) if out is None else data.stride(0)), 1
        s_view = _scale_buffer(mb, kb, scale_layout, x.device) if out is None else out[1]
        ssm, ssk = s_view.stride(0), s_view.stride(1)
    m_out = m if out is None else out[0].shape[0]  # rows stored (`_check_out`)
    if m_out and k:
        grid = (-(-m_out // tm), -(-k // tk))
        if mode == 2:  # programs walk along K (`_triton_jit._quantize_cols`)
            grid = grid[::-1]
        native = resolve_native_cast(x, native_cast)
        flag = nonfinite_flag is not None
        write_t = transposed_copy is not None
        meta = launch_meta(f.name, x.dtype, native, eps, bool(pow2_scales), flag, warps,
                           MODE=mode, WRITE_T=write_t, TM=tm, TK=tk, CHUNK=chunk,
                           STAGES=stages, PACK=pack)  # fmt: skip
        xs = x2.stride()
        if pack:  # the [K, M] codes as int32 words, M // 4 a row
            q_u8, sqk = data_t.view(torch.int32), m // 4
        args = (_bits_if_bf16(x2), q_u8, transposed_copy.view(torch.uint8) if write_t else q_u8,
                s_view, nonfinite_flag if flag else s_view, m, m_out, k, xs[0], xs[1],
                sqm, sqk, ssm, ssk)  # fmt: skip
        launch(_kernels().quantize_kernel, grid, args, meta)
        if check_finite and not bool(torch.isfinite(s_view).all()):
            _raise_like_reference(x, block, f, pow2_scales, eps, name)
    if transpose:
        return BlockQuantized(data_t, scale_t, (1, 128), f.name, bool(pow2_scales))
    scale_inv = s_view
    if out is not None:  # 2-D (checked above); R >= M rows
        return BlockQuantized(data, scale_inv, block, f.name, bool(pow2_scales))
    if x.dim() != 2:  # compact only (checked above)
        scale_inv = scale_inv.reshape(*x.shape[:-1], kb)
    return BlockQuantized(data.reshape(x.shape), scale_inv, block, f.name, bool(pow2_scales))


def quantize_with_transpose_triton(
    x: torch.Tensor, block: Block, **kwargs
) -> tuple[BlockQuantized, BlockQuantized]:
    """``(q, q.t())`` with both data layouts contiguous, from one pass over 2-D ``x``.

    For the FP8 linear's weight: FProp reads ``q`` ``[N, K]``, DGrad ``q.t()`` ``[K, N]``
    (128x128 blocks transpose into themselves); a GEMM would otherwise copy the strided view.
    ``kwargs`` are `quantize_blockwise_triton`'s."""
    f = get_format(kwargs.get("fmt", "e4m3"))
    if x.dim() != 2:
        raise ValueError(f"quantize_with_transpose_triton: needs 2-D input, got {tuple(x.shape)}")
    data_t = torch.empty(x.shape[1], x.shape[0], dtype=f.dtype, device=x.device)
    q = quantize_blockwise_triton(x, block, transposed_copy=data_t, **kwargs)
    bm, bk = q.block
    qt = BlockQuantized(data_t, q.scale_inv.t(), (bk, bm), q.fmt, q.pow2_scales)
    return q, qt


def rmsnorm_quantize_1x128(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_eps: float = 1e-6,
    fmt: str | Fp8Format = "e4m3",
    pow2_scales: bool = True,
    eps: float = 0.0,
    name: str | None = None,
    check_finite: bool = True,
    scale_layout: str = "compact",
    native_cast: bool | None = None,
    nonfinite_flag: torch.Tensor | None = None,
) -> tuple[torch.Tensor, BlockQuantized]:
    """Fused RMSNorm + 1x128 quantization of its output.

    Returns ``(y, q)`` where ``y = x * rsqrt(mean(x**2, -1) + norm_eps) * weight`` is computed in
    fp32 and rounded once to ``x.dtype`` (bf16 or fp16; TE's RMSNorm rounding), and ``q`` is
    bit-for-bit ``quantize_blockwise(y, (1, 128), ...)``. ``y`` itself agrees with a float64
    RMSNorm within one unit in the last place of ``x.dtype`` (the sum of squares is accumulated
    in fp32 in a different order than torch's). ``nonfinite_flag``: as in
    `quantize_blockwise_triton` (set when a block of ``y`` is non-finite).
    """
    f = get_format(fmt)
    label = f"rmsnorm_quantize_1x128(tensor {name!r})" if name else "rmsnorm_quantize_1x128"
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{label}: x must be bfloat16 or float16, got {x.dtype}")
    k = x.shape[-1]
    if weight.shape != (k,):
        raise ValueError(f"{label}: weight must have shape ({k},), got {tuple(weight.shape)}")
    _check_device(x, label)
    flag_kw = _flag_arg(nonfinite_flag, x, label)
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    mb, kb = m, -(-k // 128)
    y = torch.empty(m, k, dtype=x.dtype, device=x.device)
    data = torch.empty(m, k, dtype=f.dtype, device=x.device)
    s_view = _scale_buffer(mb, kb, scale_layout, x.device)
    tm = 32 if interpreting() else 8
    if m and k:
        y_store = y.view(torch.int16) if x.dtype == torch.bfloat16 else y
        _kernels().rmsnorm_quantize_kernel[(-(-m // tm),)](
            _bits_if_bf16(x2),
            _bits_if_bf16(weight.to(x.dtype).contiguous()),
            y_store,
            data.view(torch.uint8),
            s_view,
            s_view if nonfinite_flag is None else nonfinite_flag,
            m,
            k,
            x2.stride(0),
            k,
            k,
            s_view.stride(0),
            s_view.stride(1),
            _fp32(norm_eps),
            TM=tm,
            OUT_BF16=x.dtype == torch.bfloat16,
            EPS=_fp32(eps) if eps > 0 else 0.0,
            POW2=bool(pow2_scales),
            num_warps=4,
            **flag_kw,
            **NO_FTZ,
            **_format_constants(f, x.dtype, resolve_native_cast(x, native_cast)),
        )
        if check_finite and not bool(torch.isfinite(s_view).all()):
            if not bool(torch.isfinite(x).all()):
                _raise_like_reference(x, (1, 128), f, pow2_scales, eps, name)
            _raise_like_reference(y, (1, 128), f, pow2_scales, eps, name)
    y = y.reshape(x.shape)
    scale_inv = s_view if x.dim() == 2 else s_view.reshape(*x.shape[:-1], kb)
    q = BlockQuantized(data.reshape(x.shape), scale_inv, (1, 128), f.name, bool(pow2_scales))
    return y, q
