"""Converters from the compact layout to the layouts TE, vLLM and DeepGEMM consume.

Our compact layout (``BlockQuantized``): ``data`` has the logical shape ``[M, K]`` and
``scale_inv`` is ``[ceil(M/bm), ceil(K/bk)]``, one fp32 dequantization multiplier per block. The
consumers store the same numbers differently; converting never changes a value, so every
converter has an inverse and the round trip is the identity (tests/fp8/test_fp8_layouts.py).

Transformer Engine, ``Float8BlockwiseQTensor`` in its default GEMM-ready format (read from
NVIDIA/TransformerEngine ``transformer_engine/pytorch/tensor/float8_blockwise_tensor.py``,
``Float8BlockQuantizer.get_scale_shape``/``get_columnwise_shape``, TE 2.x, commit 001b23c):

* data is uint8; "rowwise" data is ``[M, K]``, "columnwise" data is the transpose ``[K, M]``.
* 2-D blocks (128x128): rowwise scale ``[ceil(M/128), pad4(ceil(K/128))]``; columnwise scale
  ``[ceil(K/128), pad4(ceil(M/128))]`` (our scale transposed).
* 1-D blocks: rowwise (1x128) scale is stored transposed, ``[ceil(K/128), pad4(M)]``; columnwise
  (128 tokens x 1, our ``(128, 1)``) scale ``[ceil(M/128), pad4(K)]``.

``pad4`` rounds up to a multiple of 4 (16-byte rows for the GEMM's TMA loads); TE leaves the
padding uninitialised, we fill it with zeros and ignore it when reading back.

vLLM (``Fp8LinearMethod`` with ``weight_block_size=[128, 128]``, v0.32): parameters ``weight``
(float8_e4m3fn ``[N, K]``) and ``weight_scale_inv`` (fp32 ``[ceil(N/128), ceil(K/128)]``, a
dequantization multiplier despite its name): exactly our compact layout.

DeepGEMM (read from deepseek-ai/DeepGEMM ``csrc/apis/layout.hpp`` at 0274ad7 and its
``tests/test_layout.py``): FP8 data is K-major ``[MN, K]`` as ours. Scale factors ("sf"):

* SM90, FP32: per-row sf (recipe granularity 1 along MN, 1x128 activations) must be MN-major and
  TMA-aligned: logical shape ``[MN, ceil(K/128)]`` with strides ``(1, align(MN, 4))``;
  128x128 weight sf are used as-is ``[ceil(N/128), ceil(K/128)]``.
* SM100, UE8M0: sf are first broadcast to one row per MN (128x128 -> per-row), each fp32 power
  of two becomes its exponent byte (``bits >> 23``), the bytes are zero-padded to
  ``[align(MN, 4), align(ceil(K/128), 4)]`` and packed 4 per int32 along K (little-endian: byte j
  of word w is K block 4w+j), stored MN-major: shape ``[MN, align(Kb, 4)/4]``, strides
  ``(1, align(MN, 4))``. Only power-of-two scales are representable (recipe ``pow2_scales``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nemo_jetrl.fp8.formats import get_format
from nemo_jetrl.fp8.quantize import BlockQuantized

TMA_ALIGN_FP32 = 4  # 16 bytes of fp32 / int32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _align(x: int, a: int) -> int:
    return _cdiv(x, a) * a


def _pad_last(t: torch.Tensor, mult: int = 4) -> torch.Tensor:
    return F.pad(t, (0, _align(t.shape[-1], mult) - t.shape[-1]))


def _check_2d(q: BlockQuantized, what: str) -> tuple[int, int]:
    if q.data.dim() != 2:
        raise ValueError(f"{what}: needs 2-D quantized data, got {tuple(q.data.shape)}")
    return q.data.shape[0], q.data.shape[1]


# --- Transformer Engine -------------------------------------------------------------------------


@dataclass(frozen=True)
class TeBlockwiseTensor:
    """The storage of a TE ``Float8BlockwiseQTensor`` (GEMM-ready scale format)."""

    shape: tuple[int, int]  # logical [M, K]
    is_2D_scaled: bool  # 128x128 blocks (True) or 1-D 1x128 / 128x1 blocks (False)
    rowwise_data: torch.Tensor | None  # uint8 [M, K]
    rowwise_scale_inv: torch.Tensor | None  # fp32, padded (see module docstring)
    columnwise_data: torch.Tensor | None  # uint8 [K, M]
    columnwise_scale_inv: torch.Tensor | None


def to_te(
    rowwise: BlockQuantized | None, columnwise: BlockQuantized | None = None
) -> TeBlockwiseTensor:
    """Pack quantizations of one tensor as TE stores them.

    1-D recipe: ``rowwise`` is the (1,128) and ``columnwise`` the (128,1) quantization of the
    same ``[M, K]`` tensor. 2-D recipe: pass the (128,128) quantization as ``rowwise``; the
    columnwise copy is its transpose (pass the same object as ``columnwise`` to get it).
    """
    qs = [q for q in (rowwise, columnwise) if q is not None]
    if not qs:
        raise ValueError("to_te: give a rowwise and/or a columnwise quantization")
    shape = _check_2d(qs[0], "to_te")
    two_d = qs[0].block == (128, 128)
    row_data = row_s = col_data = col_s = None
    if rowwise is not None:
        if rowwise.block not in ((1, 128), (128, 128)) or (rowwise.block == (128, 128)) != two_d:
            raise ValueError(f"to_te: rowwise block {rowwise.block} is not (1,128) or (128,128)")
        row_data = rowwise.data.view(torch.uint8).contiguous()
        s = rowwise.scale_inv if two_d else rowwise.scale_inv.t()
        row_s = _pad_last(s.float()).contiguous()
    if columnwise is not None:
        want = (128, 128) if two_d else (128, 1)
        if columnwise.block != want or _check_2d(columnwise, "to_te") != shape:
            raise ValueError(
                f"to_te: columnwise quantization must have block {want} and shape {shape}, "
                f"got {columnwise.block} {tuple(columnwise.data.shape)}"
            )
        col_data = columnwise.data.view(torch.uint8).t().contiguous()
        s = columnwise.scale_inv.t() if two_d else columnwise.scale_inv
        col_s = _pad_last(s.float()).contiguous()
    return TeBlockwiseTensor((shape[0], shape[1]), two_d, row_data, row_s, col_data, col_s)


def from_te(
    t: TeBlockwiseTensor, *, fmt: str = "e4m3", pow2_scales: bool = True
) -> tuple[BlockQuantized | None, BlockQuantized | None]:
    """Inverse of ``to_te``: ``(rowwise, columnwise)`` in the compact layout (padding dropped)."""
    m, k = t.shape
    dt = get_format(fmt).dtype
    row = col = None
    if t.rowwise_data is not None:
        if t.is_2D_scaled:
            s, block = t.rowwise_scale_inv[: _cdiv(m, 128), : _cdiv(k, 128)], (128, 128)
        else:
            s, block = t.rowwise_scale_inv[: _cdiv(k, 128), :m].t(), (1, 128)
        row = BlockQuantized(
            t.rowwise_data.view(dt), s.contiguous(), block, get_format(fmt).name, pow2_scales
        )
    if t.columnwise_data is not None:
        if t.is_2D_scaled:
            s, block = t.columnwise_scale_inv[: _cdiv(k, 128), : _cdiv(m, 128)].t(), (128, 128)
        else:
            s, block = t.columnwise_scale_inv[: _cdiv(m, 128), :k], (128, 1)
        data = t.columnwise_data.view(dt).t().contiguous()
        col = BlockQuantized(data, s.contiguous(), block, get_format(fmt).name, pow2_scales)
    return row, col


# --- GEMM operands -------------------------------------------------------------------------------


def pad_rows(q: BlockQuantized, rows: int) -> BlockQuantized:
    """1x128 ``q`` ``[M, K]`` with zero rows appended up to ``rows`` (scale 1 each): what a GEMM
    that takes activations in row multiples is handed; its first M output rows are ``q``'s."""
    m, k = q.data.shape
    data = torch.zeros(rows, k, dtype=q.data.dtype, device=q.data.device)
    data[:m] = q.data
    scale = torch.ones(rows, q.scale_inv.shape[1], dtype=q.scale_inv.dtype, device=data.device)
    scale[:m] = q.scale_inv
    return BlockQuantized(data, scale, q.block, q.fmt, q.pow2_scales)


# --- vLLM ---------------------------------------------------------------------------------------


def to_vllm_weight(q: BlockQuantized) -> dict[str, torch.Tensor]:
    """``{"weight": fp8 [N, K], "weight_scale_inv": fp32 [ceil(N/128), ceil(K/128)]}``."""
    _check_2d(q, "to_vllm_weight")
    if q.block != (128, 128):
        raise ValueError(f"to_vllm_weight: vLLM block-FP8 weights are 128x128, got {q.block}")
    return {"weight": q.data.contiguous(), "weight_scale_inv": q.scale_inv.float().contiguous()}


def from_vllm_weight(
    weight: torch.Tensor, weight_scale_inv: torch.Tensor, *, pow2_scales: bool
) -> BlockQuantized:
    """Inverse of ``to_vllm_weight`` (checks the scale shape against the weight's)."""
    n, k = weight.shape
    if tuple(weight_scale_inv.shape) != (_cdiv(n, 128), _cdiv(k, 128)):
        raise ValueError(
            f"from_vllm_weight: weight_scale_inv shape {tuple(weight_scale_inv.shape)} does not "
            f"match weight {tuple(weight.shape)} (want [ceil(N/128), ceil(K/128)])"
        )
    fmt = "e5m2" if weight.dtype == torch.float8_e5m2 else "e4m3"
    return BlockQuantized(weight, weight_scale_inv.float(), (128, 128), fmt, pow2_scales)


# --- DeepGEMM -----------------------------------------------------------------------------------


def deepgemm_sf_fp32(q: BlockQuantized) -> torch.Tensor:
    """SM90 FP32 scale factors: per-row (1x128) sf MN-major and TMA-aligned; 128x128 as-is."""
    mn, _ = _check_2d(q, "deepgemm_sf_fp32")
    s = q.scale_inv.float()
    if q.block == (128, 128):
        return s.contiguous()
    if q.block != (1, 128):
        raise ValueError(f"deepgemm_sf_fp32: operands are (1,128) or (128,128), got {q.block}")
    aligned = _align(mn, TMA_ALIGN_FP32)
    buf = torch.zeros(s.shape[1], aligned, dtype=torch.float32, device=s.device)
    buf[:, :mn] = s.t()
    return buf.t()[:mn]  # shape [MN, Kb], strides (1, aligned)


def deepgemm_sf_ue8m0(q: BlockQuantized) -> torch.Tensor:
    """SM100 packed UE8M0 scale factors (int32, MN-major, TMA-aligned; see module docstring)."""
    mn, _ = _check_2d(q, "deepgemm_sf_ue8m0")
    if q.block not in ((1, 128), (128, 128)):
        raise ValueError(f"deepgemm_sf_ue8m0: operands are (1,128) or (128,128), got {q.block}")
    s = q.scale_inv.float()
    if q.block[0] == 128:  # broadcast 128x128 block scales to one row per MN
        s = s.repeat_interleave(128, dim=0)[:mn]
    exp = (s.view(torch.int32) >> 23) & 0xFF
    decoded = torch.ldexp(torch.ones_like(s), exp - 127)
    if not torch.equal(decoded, s):
        bad = (decoded != s).nonzero()[0].tolist()
        raise ValueError(
            f"deepgemm_sf_ue8m0: scale_inv {float(s[bad[0], bad[1]])!r} at {bad} is not a power "
            "of two in [2**-127, 2**127]; UE8M0 needs pow2_scales=True"
        )
    kb = s.shape[1]
    aligned_mn, aligned_k = _align(mn, TMA_ALIGN_FP32), _align(kb, 4)
    padded = torch.zeros(aligned_mn, aligned_k, dtype=torch.uint8, device=s.device)
    padded[:mn, :kb] = exp.to(torch.uint8)
    packed = padded.view(torch.int32)  # little-endian: byte j of word w is K block 4w+j
    out = torch.empty(aligned_k // 4, aligned_mn, dtype=torch.int32, device=s.device).t()
    out.copy_(packed)
    return out[:mn]


def deepgemm_sf_ue8m0_decode(packed: torch.Tensor, num_k_blocks: int) -> torch.Tensor:
    """Unpack ``deepgemm_sf_ue8m0`` output to per-row fp32 scales ``[MN, num_k_blocks]``."""
    mn = packed.shape[0]
    rowmajor = torch.empty(packed.shape, dtype=torch.int32, device=packed.device).copy_(packed)
    raw = rowmajor.view(torch.uint8).reshape(mn, -1)[:, :num_k_blocks]
    return torch.ldexp(torch.ones(raw.shape, dtype=torch.float32), raw.to(torch.int32) - 127)
