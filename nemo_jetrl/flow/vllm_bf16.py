"""Linears vLLM computes in BF16 whatever the recipe says, and what keeps them on-policy.

DeepSeek MLA's kv_b_proj (`arch.mla.KV_B_ABSORBED`): vLLM's decode multiplies by BF16 W_UK_T/W_UV
dequantized from its FP8 weight and never quantizes the latent it multiplies, while training's
FP8 kv_b_proj GEMM quantizes it. `flow.graph.linear_edges` draws such a linear's rollout edges
BF16 on a vLLM rollout (`Linear.vllm_bf16_why`); here are the check's reason for them and the
words `jetrl align` adds to both per-name BF16 lists (vLLM's ignored layers, which our patch and
NeMo-RL honour; Megatron's ``linear_kv_up_proj`` through `megatron.bf16_names`).
"""

from __future__ import annotations

from nemo_jetrl.arch import ModelArch
from nemo_jetrl.config.layer_lists import ROLLOUT_KEY, TRAIN_KEY, list_fix
from nemo_jetrl.flow.graph import Precision, linear_edges
from nemo_jetrl.recipe import Recipe


def vllm_bf16_mismatch(
    kind: str, roll: Precision, recipe: Recipe, words: tuple[str, ...] = ()
) -> tuple:
    """(reason, keys, fixes, severity) of a rollout edge of linear ``kind`` that vLLM runs BF16
    (``roll.why`` says why): only keeping that linear BF16 on both sides matches. The fix sets
    both lists to ``words`` (the flow's `flow.fixes.list_fix_words`) with ``kind``."""
    words = tuple(dict.fromkeys((*(words or recipe.bf16_layer_kws()), kind)))
    return (
        f"{roll.why}. Keep {kind} BF16 on both sides: add {kind!r} to {ROLLOUT_KEY} (vLLM then "
        f"serves it unquantized) and {TRAIN_KEY} (Megatron runs it outside FP8); `jetrl align` "
        "writes both",
        (ROLLOUT_KEY, TRAIN_KEY),
        list_fix(recipe.train, words),
        "always",
    )


def vllm_bf16_kinds(arch: ModelArch | None, recipe: Recipe) -> list[str]:
    """Kinds of the linears a vLLM rollout of ``recipe`` would run FP8 but vLLM computes in BF16,
    in model order: the per-name words `jetrl align` adds to both sides."""
    if arch is None:
        return []
    edges = linear_edges(arch, recipe, "rollout")
    return list(dict.fromkeys(e.kind for e in edges if e.precision.why is not None))


def vllm_bf16_words(arch: ModelArch | None, recipe: Recipe) -> tuple[tuple[str, ...], list[str]]:
    """(per-name words to add to both sides' BF16 lists, one note per word) for the linears a
    vLLM rollout of ``recipe`` computes in BF16 (`vllm_bf16_kinds`): `jetrl align`'s fix."""
    kinds = vllm_bf16_kinds(arch, recipe)
    notes = [
        f"{kind}: vLLM's rollout computes it in BF16 whatever the recipe says (for MLA: decode "
        f"multiplies by the BF16 W_UK_T/W_UV dequantized from it, never quantizing its input); "
        f"align adds {kind!r} to {ROLLOUT_KEY} and {TRAIN_KEY}, so both sides keep it BF16"
        for kind in kinds
    ]
    return tuple(kinds), notes
