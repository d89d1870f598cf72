"""The hybrid-attention stand-in (Qwen3.5: gated DeltaNet beside full attention, dense or MoE):
its tiny HF config, the processor files vLLM's multimodal class loads, the vLLM keys its CPU
engine needs, and the CPU policy's MoE block with Qwen3.5's shared expert.

vLLM serves Qwen3.5 only as the multimodal class (``Qwen3_5ForConditionalGeneration``, the MoE
one for 35B-A3B; the text class is refused: "Expected Qwen3_5Config"), so the stand-in is that
class with a one-block vision tower. Its decoder keeps the real model's layer kinds (a linear-
attention layer, then the full-attention layer that ends each ``full_attention_interval``), the
gated DeltaNet's head ratio (value heads per key head), head_dim 256 and the output gate; every
FP8 dimension is whole 128-blocks (q, k, v, z of the GDN ``in_proj``: 128, 128, 256, 256).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

# model_type of the multimodal checkpoint (what vLLM serves) -> its text decoder's
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
ARCHITECTURES = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
HEAD_DIM = 256  # Qwen3.5's (two 128-blocks per head)


def multimodal_type(model_type: str) -> str | None:
    """The multimodal checkpoint's model_type for a Qwen3.5 family (text or not), else None."""
    base = model_type.removesuffix("_text")
    return base if base in MULTIMODAL else None


def vllm_keys() -> dict[str, Any]:
    """What vLLM 0.25.1's CPU engine needs to serve the stand-in (NeMo-RL hands
    ``policy.generation.vllm_kwargs`` to ``vllm.LLM``), each measured (docs/rehearsal.md):"""
    return {
        # its CPU gated-DeltaNet kernel (chunk_gated_delta_rule_cpu) keeps the recurrent state in
        # float32 and refuses a BF16 state cache ("Input tensor dtype mismatch"); a GPU runs
        # the model dtype
        "policy.generation.vllm_kwargs.mamba_ssm_cache_dtype": "float32",
        # text prompts only: vLLM's multimodal profiling would otherwise build dummy images
        # whose <|image_pad|> tokens the one-character tokenizer lacks
        "policy.generation.vllm_kwargs.limit_mm_per_prompt": {"image": 0, "video": 0},
    }


def tiny_hybrid_config(arch: Any, keys: dict[str, Any], moe: dict[str, Any] | None) -> Any:
    """The multimodal HF config of the stand-in; ``keys``: the dense stand-in's decoder keys
    (sizes, tokens), ``moe``: Qwen3.5-MoE's expert keys (None: dense)."""
    from transformers import AutoConfig

    h = arch.hybrid
    top = multimodal_type(arch.model_type)
    hidden = keys["hidden_size"]
    text = {k: v for k, v in keys.items() if k not in ("tie_word_embeddings", "attention_bias")}
    text.update(
        model_type=MULTIMODAL[top],
        head_dim=HEAD_DIM,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=1,
        linear_num_value_heads=max(1, h.num_v_heads // h.num_k_heads),
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=h.conv_kernel,
    )
    if moe is not None:
        text.pop("intermediate_size", None)
        text.update(moe)
    vision = dict(depth=1, hidden_size=128, intermediate_size=128, num_heads=1,
                  out_hidden_size=hidden, num_position_embeddings=64)  # fmt: skip
    config = AutoConfig.for_model(
        top, text_config=text, vision_config=vision,
        tie_word_embeddings=bool(keys["tie_word_embeddings"]),
    )  # fmt: skip
    config.architectures = [ARCHITECTURES[top]]
    return config


def text_config(config: Any) -> Any:
    """The decoder's config (a multimodal config's ``text_config``; else the config itself)."""
    return getattr(config, "text_config", None) or config


def model_class(config: Any) -> Any:
    """The HF auto class that builds ``config``'s checkpoint class."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM


def write_processors(dest: Path) -> None:
    """The image and video processors vLLM's Qwen3.5 class loads at start (no image reaches
    them: `vllm_keys` limits prompts to text)."""
    from transformers import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    for cls in (Qwen2VLImageProcessor, Qwen3VLVideoProcessor):
        cls(patch_size=16, merge_size=2, temporal_patch_size=2).save_pretrained(dest)


class _SharedExpertMoe(nn.Module):
    """Qwen3.5-MoE's block on the local backend's routed experts: ``routed`` (a `MoeBlock`:
    router, top-k renormalised as Qwen3.5's router always does, FP8 experts) plus
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``. The routed block's router and experts
    are this module's children and the block itself is not, so parameter and state-dict names
    stay HF's (``mlp.gate.weight``, ``mlp.experts.gate_up_proj``), each once."""

    def __init__(self, hf_block: nn.Module, routed: nn.Module) -> None:
        super().__init__()
        self.gate, self.experts = routed.gate, routed.experts
        self.shared_expert = hf_block.shared_expert
        self.shared_expert_gate = hf_block.shared_expert_gate
        object.__setattr__(self, "routed", routed)  # not a child: its modules are ours

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return self.routed(hidden) + shared


def convert_shared_expert_moe(model: nn.Module, side: Any, cfg: Any, layers: int) -> list[str]:
    """Swap each Qwen3.5-MoE block for `_SharedExpertMoe` (training side: parameters shared,
    experts FP8 where the side's filters say); the FP8 expert projections' names."""
    from nemo_jetrl.backends.local.moe import _LAYER_RE, MoeBlock, _expert_fp8
    from nemo_jetrl.backends.local.moe_experts import Experts

    fp8_names: list[str] = []
    for name, mod in list(model.named_modules()):
        if not (type(mod).__name__.endswith("SparseMoeBlock") and hasattr(mod, "shared_expert")):
            continue
        fp8, _kept = _expert_fp8(f"{name}.experts", mod.experts, side, cfg, layers)
        experts = Experts.for_training(mod.experts, f"{name}.experts", fp8)
        top_k = int(text_config(model.config).num_experts_per_tok)
        routed = MoeBlock(mod.gate, experts, top_k=top_k, normalize=True,
                          layer=int(_LAYER_RE.search(f"{name}.").group(1)))  # fmt: skip
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, _SharedExpertMoe(mod, routed))
        fp8_names += [f"{name}.experts.{w}" for w in fp8]
    return fp8_names


class DecoderView(nn.Module):
    """``model`` seen with its decoder's config, for the trainer conversion (which reads
    ``config.num_hidden_layers``; a multimodal config has it under ``text_config``). No MoE
    key: the MoE blocks are swapped first (`convert_shared_expert_moe`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        from types import SimpleNamespace

        self.model = model
        self.config = SimpleNamespace(
            num_hidden_layers=int(text_config(model.config).num_hidden_layers)
        )
