"""The local backend's model: a small HuggingFace causal LM built from a config kept in the repo.

``assets/model_config.json`` describes a 2-layer Llama (hidden 256, MLP 512, 4 query heads and 2
KV heads of 64) whose every decoder linear has both dimensions a multiple of 128, so every one of
them can run as a 128x128-block FP8 linear; embeddings, norms, attention math and ``lm_head`` stay
in BF16 as in the recipe. Any Llama, Qwen2, Qwen3 (its per-head q/k RMSNorms made batch-invariant
like every norm), Qwen3-MoE or Mixtral ``config.json`` can be used instead
(``jetrl.local.model_config``; MoE blocks: `nemo_jetrl.backends.local.moe`); weights are
initialised from a seed, never downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from nemo_jetrl._optional import require

ASSETS = Path(__file__).resolve().parent / "assets"
MODEL_CONFIG_JSON = ASSETS / "model_config.json"
SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")


def load_model_config(path: str | Path | None = None) -> Any:
    """A transformers ``PretrainedConfig`` (one of `SUPPORTED_TYPES`) from a JSON file."""
    transformers = require("transformers", feature="the local backend's model")
    path = Path(path) if path else MODEL_CONFIG_JSON
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"model config {path} not found; set jetrl.local.model_config to a config.json"
        ) from None
    mtype = raw.pop("model_type", None)
    if mtype not in SUPPORTED_TYPES:
        raise ValueError(
            f"{path}: model_type {mtype!r} is not supported by the local backend; "
            f"use one of {SUPPORTED_TYPES}"
        )
    raw.pop("architectures", None)
    return transformers.AutoConfig.for_model(mtype, **raw)


def build_model(
    config: Any, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.nn.Module:
    """A freshly initialised causal LM (seeded, eager attention, in eval mode, on CPU)."""
    transformers = require("transformers", feature="the local backend's model")
    config._attn_implementation = "eager"  # same math in rollout and trainer; no SDPA variants
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = config.pad_token_id
    return model.to(dtype).eval()


def is_fp8_linear_name(name: str) -> bool:
    """True for the decoder linears an FP8 recipe quantizes (never embeddings or ``lm_head``)."""
    return ".layers." in name and name.rsplit(".", 1)[-1].endswith("_proj")
