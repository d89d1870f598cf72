"""Tiny real HuggingFace models for tests: one place that builds their configs.

`tiny_hf_config(model_type, **fields)` is a small config of any transformers model type
(defaults below; ``fields`` override them); `tiny_hf_model` builds the model from it with a
given seed without disturbing the global RNG.
"""

from __future__ import annotations

from typing import Any

import torch

TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
}


def tiny_hf_config(model_type: str = "llama", **fields: Any) -> Any:
    """A transformers config of ``model_type`` with `TINY_DEFAULTS` updated by ``fields``."""
    import transformers

    return transformers.AutoConfig.for_model(model_type, **(TINY_DEFAULTS | fields))


def tiny_hf_model(
    config: Any, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` initialised from ``seed`` (the global RNG is
    left as it was), cast to ``dtype``, in eval mode."""
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval()
