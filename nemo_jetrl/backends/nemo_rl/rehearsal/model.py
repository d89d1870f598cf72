"""The rehearsal's model, tokenizer and prompts: the config's model family shrunk to run on CPU.

The model is the same HF architecture class (``model_type`` from `nemo_jetrl.arch`) with the
real model's layer kinds (grouped KV heads, q/k norms, biases, tied embeddings) and its tail blocks
(a dimension that is not a multiple of 128 keeps a partial block), the dims shrunk to two
128-blocks (hidden: two heads of 128) and the layers to `LAYERS`, weights random from a seed.
A mixture of experts (`MOE_FAMILIES`: Qwen3-MoE) keeps its router, its top-k renormalisation
(``norm_topk_prob``) and which of the kept layers are MoE, with `EXPERTS` experts of one
128-block (plus the real tail), `TOP_K` per token. Qwen3.5 (hybrid attention, dense or MoE
with its shared expert) is built as vLLM serves it, the multimodal class (`hybrid.py`). MLA and
Qwen3-Next have no stand-in: `families.family_refusal` (asked first by `jetrl rehearse`) says
whether this env's vLLM CPU engine could serve them and what to do instead. The tokenizer is one token
per printable ASCII character (NeMo-RL's prompts and answers are plain text) whose chat
template joins the messages' contents. The prompts are small sums with
their answers, in the jsonl NeMo-RL's ``ResponseDataset`` reads.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

LAYERS = 2
BLOCK = 128
SPECIALS = ("<pad>", "<bos>", "<eos>")
CHARS = tuple(string.printable[:95])  # digits, letters, punctuation, space
PROMPTS = 8
EXPERTS, TOP_K = 4, 2  # a few experts, more than one routed per token (as every real MoE)
# MoE families with a stand-in: model_type -> the top-k renormalisation when config.json does
# not say (Qwen3-30B-A3B's and -235B-A22B's config.json: norm_topk_prob true; transformers'
# Qwen3MoeConfig default is false, so the stand-in must not take the default)
MOE_FAMILIES = {"qwen3_moe": True}
# (Qwen3.5-MoE, with its shared expert, has its own stand-in: `hybrid.py`)


class UnsupportedFamily(ValueError):
    """The config's model family has no tiny stand-in yet (named)."""


def _shrunk(real: int, blocks: int) -> int:
    """``blocks`` 128-blocks, plus the real dimension's tail (its size mod 128) if it has one."""
    return blocks * BLOCK + real % BLOCK


def tiny_config(arch: Any, vocab_size: int) -> Any:
    """The HF config of the tiny model of ``arch``'s family (a `ModelArch`)."""
    from transformers import AutoConfig

    from nemo_jetrl.backends.nemo_rl.rehearsal import hybrid

    qwen35 = arch.hybrid is not None and hybrid.multimodal_type(arch.model_type) is not None
    if arch.mla is not None or (arch.hybrid is not None and not qwen35):
        kind = "MLA" if arch.mla else "hybrid attention"
        raise UnsupportedFamily(
            f"{arch.name} ({arch.model_type}, {kind}): jetrl rehearse has no stand-in for "
            f"{kind} yet (dense and {', '.join(MOE_FAMILIES)} models only; `jetrl rehearse` "
            "says whether this env's vLLM CPU engine could serve it); run `jetrl check` on it "
            "and rehearse a config of the same recipe with a model of those families"
        )
    if arch.moe is not None and not qwen35 and arch.model_type not in MOE_FAMILIES:
        raise UnsupportedFamily(
            f"{arch.name} ({arch.model_type}, mixture of experts): jetrl rehearse has a "
            f"mixture-of-experts stand-in for {', '.join(MOE_FAMILIES)} only; run `jetrl check` "
            "on it and rehearse a config of the same recipe with a Qwen3-MoE model (e.g. "
            "policy.model_name=Qwen/Qwen3-30B-A3B)"
        )
    # head_dim 128: q, k and v each whole FP8 blocks (vLLM loads each one's block scales apart);
    # hidden = heads * head_dim, so families without a head_dim key agree
    heads, head_dim = 2, BLOCK
    grouped = arch.num_kv_heads < arch.num_heads
    keys = dict(
        hidden_size=_shrunk(arch.hidden_size, heads),
        intermediate_size=_shrunk(arch.intermediate_size, 2),
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=1 if grouped else heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        tie_word_embeddings=bool(arch.tie_word_embeddings),
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch.model_type in ("llama", "qwen3", "mistral", "qwen3_moe"):
        keys["attention_bias"] = bool(arch.qkv_bias)
    if qwen35:
        return hybrid.tiny_hybrid_config(arch, keys, _moe_keys(arch) if arch.moe else None)
    if arch.moe is not None:
        keys.update(_moe_keys(arch))
    config = AutoConfig.for_model(arch.model_type, **keys)
    config.architectures = [_architecture(arch.model_type)]
    return config


def _moe_keys(arch: Any) -> dict[str, Any]:
    """The MoE keys of the stand-in of ``arch`` (a Qwen3-MoE): its experts shrunk, its router
    rule and its MoE layers among the kept `LAYERS` (the others dense, as in the real model)."""
    moe, real = arch.moe, dict(arch.hf_config or {})
    keys = dict(
        num_experts=min(moe.num_experts, EXPERTS),
        num_experts_per_tok=min(moe.top_k, TOP_K),
        moe_intermediate_size=_shrunk(moe.expert_size, 1),
    )
    if moe.shared_size:  # Qwen3.5-MoE: every layer MoE, one gated shared expert
        return {**keys, "shared_expert_intermediate_size": _shrunk(moe.shared_size, 1)}
    dense = [i for i in range(LAYERS) if i not in moe.moe_layers]
    if len(dense) == LAYERS:  # the first layers all dense: keep one MoE layer (the last)
        dense = dense[:-1]
    return dict(
        **keys,
        norm_topk_prob=bool(real.get("norm_topk_prob", MOE_FAMILIES[arch.model_type])),
        decoder_sparse_step=1,  # which layers are MoE: said by mlp_only_layers alone
        mlp_only_layers=dense,
    )


def _architecture(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def build_tokenizer() -> Any:
    """One token per printable ASCII character, ``<pad>``/``<bos>``/``<eos>`` first."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=SPECIALS[0], bos_token=SPECIALS[1], eos_token=SPECIALS[2]
    )
    out.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return out


def write_model(arch: Any, dest: Path, seed: int = 0) -> Path:
    """The tiny model (random weights from ``seed``) and its tokenizer, saved in ``dest``."""
    import torch

    from nemo_jetrl.backends.nemo_rl.rehearsal import hybrid

    tok = build_tokenizer()
    vocab = -(-len(tok) // BLOCK) * BLOCK  # a whole number of blocks
    torch.manual_seed(seed)
    config = tiny_config(arch, vocab)
    model = hybrid.model_class(config).from_config(config, dtype=torch.float32)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    if hasattr(config, "vision_config"):
        hybrid.write_processors(dest)
    return dest


def write_prompts(dest: Path, count: int = PROMPTS) -> Path:
    """``count`` sums with their answers, as NeMo-RL's ``ResponseDataset`` jsonl."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"input": f"{a}+{a + 3}=", "output": str(2 * a + 3)} for a in range(1, count + 1)]
    dest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dest
