"""Tiny real HuggingFace models for tests: one place that builds their configs.

`tiny_hf_config(model_type, **fields)` is a small config of any transformers model type
(defaults below; ``fields`` override them); `tiny_hf_model` builds the model from it with a
given seed without disturbing the global RNG.
"""

from __future__ import annotations

from pathlib import Path
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


def tiny_llama_128(seed: int = 0) -> torch.nn.Module:
    """The vLLM tests' model: a BF16 Llama with 2 layers, hidden 256, head_dim 128, so all 14
    decoder linears (and lm_head) have dims that are multiples of 128 and run in block FP8."""
    cfg = tiny_hf_config(
        "llama",
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.08,  # larger than usual so logits are far from uniform
    )
    return tiny_hf_model(cfg, seed=seed, dtype=torch.bfloat16)


def char_tokenizer() -> Any:
    """A character-level fast tokenizer (printable ASCII, ids 4..98; <pad> 0, <s> 1, </s> 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in map(chr, range(32, 127)):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def save_tiny_llama(directory: Path) -> Path:
    """`tiny_llama_128` (seed 0) and `char_tokenizer` saved as a checkpoint in ``directory``."""
    tiny_llama_128(0).save_pretrained(directory)
    char_tokenizer().save_pretrained(directory)
    return directory


def qwen3_moe_128(
    seed: int, *, experts: int, inter: int, layers: int, mlp_only_layers: list[int], **fields: Any
) -> torch.nn.Module:
    """The MoE tests' model: a BF16 Qwen3-MoE with hidden 256, top-2 routing over ``experts`` of
    width ``inter`` and head_dim 128 (every linear in whole 128-blocks); ``fields`` set the rest
    of the config (``num_key_value_heads`` 1 unless given, ``initializer_range``)."""
    cfg = tiny_hf_config(
        "qwen3_moe",
        **{
            "vocab_size": 128,
            "hidden_size": 256,
            "intermediate_size": 256,
            "moe_intermediate_size": inter,
            "num_experts": experts,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "mlp_only_layers": mlp_only_layers,
            "decoder_sparse_step": 1,
            "num_hidden_layers": layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 128,
            "max_position_embeddings": 256,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
            **fields,
        },
    )
    return tiny_hf_model(cfg, seed=seed, dtype=torch.bfloat16)


def per_expert_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict under HF checkpoint names (``mlp.experts.{e}.{gate,up,down}_proj.
    weight``) from transformers 5's fused 3-D expert parameters (``experts.gate_up_proj``:
    gate rows first, then up)."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :half].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, half:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            out.update({f"{base}{e}.down_proj.weight": t[e].clone() for e in range(t.shape[0])})
        else:
            out[name] = t.detach().clone()
    return out
