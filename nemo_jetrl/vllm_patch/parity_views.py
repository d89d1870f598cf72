"""How the refit's parity check compares an engine tensor with what the trainer sent.

* `differ`: raw bytes (FP8 weights, scales, parameters that hold what was sent) or values (a
  weight read through the layer's GEMM, where +0 and -0 are the same).
* MLA (DeepSeek-V2/V3, Moonlight): vLLM's ``MLAAttention.process_weights_after_loading`` derives
  BF16 copies of ``kv_b_proj`` that its decode path multiplies with: the weight dequantized
  (``split_kv_b_proj`` -> ``get_and_maybe_dequant_weights`` -> ``scaled_dequantize``: FP8 value
  times its block's scale in fp32, one cast to the model dtype) and split per head into
  ``W_UK_T`` [heads, qk_nope, kv_lora] and ``W_UV`` [heads, kv_lora, v]. A refit must rebuild
  them (vLLM's layerwise reload runs attention layers' processing after the linears'); the
  worker reads them back as one ``name|mla`` view, `derived_view` (a lossless relayout into
  kv_b_proj's [heads*(qk_nope+v), kv_lora]), compared byte for byte with `expected_view` of the
  sent bytes and scales. vLLM 0.32's ``AMX_MLA`` backend keeps no such copies (it requantizes
  kv_b_proj per tensor and empties its weight): `MISSING` names that.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_jetrl.fp8.spec import WEIGHT_BLOCK

VIEW = "mla"  # read-back key suffix: "<kv_b_proj>.weight|mla"
MISSING = (
    "vLLM derived no W_UK_T/W_UV from it (its AMX_MLA backend requantizes kv_b_proj per tensor "
    "and keeps its own packed copies, not the recipe's blocks); start the engine with "
    "attention_backend='CPU_MLA'"
)


def differ(got: torch.Tensor, want: torch.Tensor, *, bytewise: bool) -> str | None:
    """None if equal, else how they differ (bytewise: raw bytes; else values, so +0 == -0)."""
    if got.shape != want.shape:
        return f"engine {got.dtype} {tuple(got.shape)}, trainer {tuple(want.shape)}"
    if bytewise:
        if got.dtype != want.dtype:
            want = want.to(got.dtype)  # what vLLM's loader's copy_ makes of it
        gb, wb = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
        if torch.equal(gb, wb):  # no mask of the tensor's size unless something differs
            return None
        return f"{int((gb != wb).sum())} of {wb.numel()} bytes differ"
    if torch.equal(got, want.to(got.dtype)):
        return None
    return f"{int((got != want.to(got.dtype)).sum())} of {got.numel()} values differ"


def attention_by_kv_b(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """id(kv_b_proj layer) -> the vLLM MLA attention layer that derives tensors from it (the
    layer with an ``impl`` and a ``kv_b_proj``; the model's wrappers hold no ``impl``)."""
    return {
        id(m.kv_b_proj): m
        for m in model.modules()
        if hasattr(m, "impl") and isinstance(getattr(m, "kv_b_proj", None), torch.nn.Module)
    }


def derived_view(attn: Any) -> torch.Tensor:
    """``attn``'s W_UK_T and W_UV put back as kv_b_proj's [heads*(nope+v), kv_lora] rows (on the
    host), or an empty tensor when it holds none."""
    uk_t, uv = getattr(attn, "W_UK_T", None), getattr(attn, "W_UV", None)
    if not isinstance(uk_t, torch.Tensor) or not isinstance(uv, torch.Tensor):
        return torch.empty(0)
    rank = uk_t.shape[2]  # W_UK_T [N, P, L]; W_UV [N, L, V]
    rows = torch.cat([uk_t.permute(0, 2, 1), uv], dim=-1)  # [N, L, P + V]
    return rows.permute(0, 2, 1).reshape(-1, rank).detach().to("cpu")


def expected_view(weight: torch.Tensor, scale_inv: torch.Tensor | None, dtype: torch.dtype):
    """What vLLM derives from the sent kv_b_proj ``weight`` (FP8 with ``scale_inv``, or not)."""
    if scale_inv is None:
        return weight.to(dtype)
    bn, bk = WEIGHT_BLOCK
    rows, cols = weight.shape
    s = scale_inv.to(torch.float32).repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)
    return (weight.to(torch.float32) * s[:, :cols]).to(dtype)


def view_problem(
    got: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None
) -> str | None:
    """How the engine's MLA view ``got`` differs from what vLLM derives from the sent tensors."""
    if got.numel() == 0:
        return MISSING
    why = differ(got, expected_view(weight, scale_inv, got.dtype), bytewise=True)
    return None if why is None else f"vLLM's W_UK_T/W_UV derived from it: {why}"
