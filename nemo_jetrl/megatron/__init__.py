"""Megatron-Core / Transformer Engine side of a recipe.

- `config`: Recipe -> Megatron ``TransformerConfig`` fields, TE ``Float8BlockScaling`` settings and
  the ``NVTE_*`` environment variables (with a guard for TE's import-time reading of them).
- `attention`: Q/K/V calibration observers and the on-policy KV hook on Megatron's
  ``core_attention`` modules (post-RoPE Q, K, V).
- `export`: Megatron parameter names -> HuggingFace names (unfusing ``linear_qkv`` and
  ``linear_fc1``) and FP8 (data, scale_inv) for refit, from the master weights or from TE's own
  FP8 weights.

Importing this package imports neither megatron-core nor Transformer Engine; the functions that
need them import them lazily.
"""
