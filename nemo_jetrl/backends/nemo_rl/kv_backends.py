"""Which vLLM attention backends an on-policy FP8 KV cache can run on, judged per engine worker.

The trainer's on-policy KV (`megatron.attention`) fake-quantizes keys and values with the scales
each refit sends; the rollout's attention must then read exactly those K/V and compute the rest
as training does. Two kinds of vLLM attention break that on CUDA (read in vLLM 0.20/0.25/0.32):

* FlashInfer folds the K/V scales it first sees into its own (bmm1/bmm2 scales, held by the CUDA
  graphs too): the scales a refit sends are never used.
* A backend that takes FP8 queries (FlashAttention 3, Triton attention on CUDA: vLLM builds the
  layer's ``query_quant`` for it) quantizes every query with ``q_scale`` and multiplies FP8
  softmax probabilities with V, which no trainer hook models.

FlexAttention has no FP8 cache at all, so no vLLM attention on CUDA qualifies (`CUDA_FP8_KV`).
The engine check (`engine_check.judge`) refuses both before the first step; the launch refuses an
FP8 KV recipe where vLLM's platform is CUDA, before Ray starts (`launch.preflight_vllm_patch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CUDA_FP8_KV = (
    "no vLLM attention on CUDA serves an on-policy FP8 KV cache (read in vLLM 0.20-0.32): "
    "FlashInfer never uses the K/V scales a refit sends, FlashAttention 3 and Triton attention "
    "quantize the queries and the softmax probabilities to FP8, FlexAttention has no FP8 cache"
)
"""Why an FP8 KV cache on vLLM's CUDA platform is refused (the one home of this fact)."""


def fp8_kv_attention_impls(model: Any, *, fp8_queries: bool = False) -> list[str]:
    """The attention implementations (class names) of the layers whose KV cache is FP8;
    ``fp8_queries``: only those that quantize the queries too (vLLM's ``query_quant``, built
    when the backend takes FP8 queries: FlashAttention 3 and Triton attention on CUDA)."""
    return sorted({
        type(m.impl).__name__ for m in model.modules()
        if hasattr(m, "impl") and str(getattr(m, "kv_cache_dtype", "")).startswith("fp8")
        and (not fp8_queries or getattr(m, "query_quant", None) is not None)
    })  # fmt: skip


def kv_backend_problems(report: Mapping[str, Any], rank: int) -> list[str]:
    """Why worker ``rank``'s FP8-KV attention (its `engine_check.worker_status` report) cannot
    serve an on-policy FP8 KV cache (empty: it can)."""
    out = []
    flash = [n for n in report.get("fp8_kv_attention", []) if n.startswith("FlashInfer")]
    if flash:
        out.append(
            f"worker {rank}: FP8 KV cache on FlashInfer attention ({', '.join(flash)}): "
            "FlashInfer folds the K/V scales it first sees into its own (bmm1/bmm2 scales, held "
            "by the CUDA graphs too), so the scales each refit sends would not be used: keep the "
            "KV cache BF16 (recipe jetrl)"
        )
    if queries := report.get("fp8_kv_query_quant", []):
        out.append(
            f"worker {rank}: FP8 KV cache on {', '.join(queries)} with FP8 queries: vLLM "
            "quantizes every query with q_scale and the kernel multiplies FP8 softmax "
            "probabilities with V (vLLM 0.20-0.32 FlashAttention 3 and Triton attention on "
            "CUDA), where the trainer's on-policy KV quantizes keys and values only: the "
            "rollout's attention is not the training forward's. Keep the KV cache BF16 (recipe "
            "jetrl)"
        )
    return out
