"""Linears FP8 cannot run: `jetrl align` keeps them BF16 by name on both sides.

Blockwise FP8 runs partial 128-blocks (Moonlight's and DeepSeek-V3's MLA ``kv_a_proj_with_mqa``,
kv_lora_rank + qk_rope_head_dim = 576 rows, stays FP8) but not dims TE's FP8 GEMM refuses
(in % 16, out % 8: `fp8.spec.linear_dims_problem`); fused experts and MXFP8 need multiples of
128 (`arch.linear.Linear.fits`; the check refuses otherwise,
`config.validate._check_alignment`). Align adds one per-name word per such linear kind to both
lists, which is what each side really honours:

- rollout, ``policy.generation.vllm_cfg.quantization_ignored_layer_kws``: NeMo-RL's ``init_fp8``
  (v0.7.0 and main) puts every ``model.<AutoModel parameter>`` containing a word into
  ``quantization_config.ignored_layers``; vLLM's ``Fp8Config.get_quant_method`` (0.20, 0.25.1)
  gives a prefix found there ``UnquantizedLinearMethod`` (BF16).
- training, ``jetrl.train_bf16_layer_kws``: NeMo-RL has no training-side list in either tree;
  our Megatron policy worker (a subclass of both trees' ``MegatronPolicyWorkerImpl``) runs the
  matching Megatron modules outside TE's FP8 autocast (`nemo_jetrl.megatron.bf16_names`, MLA
  projections included).

``jetrl.unaligned_layers: bf16`` says the same to the flow but neither NeMo-RL side reads it, so
align writes the words. vLLM runs a fused group as one GEMM (``fused_qkv_a_proj`` = q_a_proj +
kv_a_proj_with_mqa in DeepSeek-V3), so a word goes in with its group's other members.
"""

from __future__ import annotations

import re
from typing import Any

from nemo_jetrl.config import Settings
from nemo_jetrl.config.layer_lists import FUSED_GROUPS, ROLLOUT_KEY, TRAIN_KEY, whole_in_proj_words
from nemo_jetrl.fp8.spec import BLOCK, linear_dims_problem

_BLOCKED = ("blockwise", "mxfp8")


def _needs_tiling(recipe: Any) -> bool:
    return any(s.fp8_linears and s.scaling in _BLOCKED for s in (recipe.train, recipe.rollout))


def unaligned_words(
    arch: Any, kws: tuple[str, ...], scalings: tuple[str, ...] = ("blockwise",)
) -> tuple[tuple[str, ...], list[str]]:
    """(words to add to ``kws`` on both sides, notes naming each linear kind and why) for the
    FP8-capable decoder linears of ``arch`` some side's ``scalings`` cannot run (`Linear.fits`:
    blockwise takes partial 128-blocks under TE's dims rule; experts and MXFP8 need multiples
    of 128)."""
    if arch is None:
        return (), []
    decoder = [x for i in range(arch.num_layers) for x in arch.layer_linears(i)]
    every = [*decoder, *arch.nondecoder_linears()]
    kinds: dict[str, list[Any]] = {}
    for x in decoder:
        if x.fp8_capable and not all(x.fits(s) for s in scalings):
            kinds.setdefault(x.kind, []).append(x)
    words: list[str] = []
    notes: list[str] = []
    for kind, xs in kinds.items():
        x = xs[0]
        what = (
            f"{re.sub(r'[.]layers[.][0-9]+[.]', '.layers.*.', x.name)} "
            f"[{x.out_features}, {x.in_features}] in {len(xs)} layer(s): "
            + next(_unfit(x, s) for s in scalings if not x.fits(s))
        )
        covering = [k for k in kws if all(k in y.name for y in xs)]
        if covering:
            notes.append(f"{what}; BF16 on both sides through the per-name word {covering[0]!r}")
            continue
        if x.group == "experts" or any(kind in y.name for y in every if y.kind != kind):
            notes.append(
                f"{what}; align adds no word for it ({kind!r} would name other linears too): "
                f"list these linears in {ROLLOUT_KEY} and {TRAIN_KEY}"
            )
            continue
        words.append(kind)
        notes.append(f"{what}; align adds {kind!r} to {ROLLOUT_KEY} and {TRAIN_KEY}")
        present = {y.kind for y in decoder if y.layer == x.layer}
        group = next((g for g in FUSED_GROUPS if kind in g), ())
        for partner in group:
            kept = any(k in y.name for k in (*kws, *words) for y in decoder if y.kind == partner)
            if partner in present and not kept:
                words.append(partner)
                notes.append(
                    f"{partner!r} added too: vLLM runs it with {kind} as one fused GEMM "
                    f"({'/'.join(group)}), which has one precision"
                )
    return tuple(words), notes


def _unfit(x: Any, scaling: str) -> str:
    if scaling == "blockwise" and x.group != "experts":
        return f"{linear_dims_problem(x.in_features, x.out_features)}"
    what = "MXFP8" if scaling == "mxfp8" else "fused experts"
    return f"a dim is not a multiple of {BLOCK}, which {what} needs"


def _scalings(recipe: Any) -> tuple[str, ...]:
    return tuple({s.scaling for s in (recipe.train, recipe.rollout)
                  if s.fp8_linears and s.scaling in _BLOCKED})  # fmt: skip


def unaligned_target_words(
    arch: Any, recipe: Any, kws: tuple[str, ...]
) -> tuple[tuple[str, ...], list[str]]:
    """`unaligned_words` when ``recipe`` (what align writes) runs blockwise or MX FP8 on a side;
    nothing otherwise (a BF16 run tiles nothing)."""
    if not _needs_tiling(recipe):
        return (), []
    return unaligned_words(arch, kws, _scalings(recipe))


def in_proj_note(before: Any, after: Any) -> str:
    """Why align replaced words keeping part of Megatron's fused in_proj by the whole one."""
    return (
        f"{[k for k in before if k not in after]} -> {[k for k in after if k not in before]}: "
        "megatron-core computes the gated delta net's in_proj (q, k, v, z, b, a) as one GEMM, "
        "so only a word naming all of it can be BF16 in training; vLLM keeps in_proj_qkvz "
        "and in_proj_ba BF16 for it"
    )


def unaligned_list_overrides(settings: Settings, arch: Any) -> tuple[list[str], list[str]]:
    """(``++`` overrides adding the words to both lists of an input the check refuses for its
    untiled linears, the training list taken from the rollout's when absent; the notes):
    nothing when no word is needed or the two lists differ (a mismatch the user settles). Words
    keeping part of Megatron's fused in_proj BF16 become ``linear_attn.in_proj`` (Qwen3.5's
    in_proj_a/b: `layer_lists.whole_in_proj_words`)."""
    roll = list(settings.rollout_kws or ())
    train = list(settings.train_kws) if settings.train_kws is not None else None
    if train is not None and train != roll:
        return [], []
    whole = list(whole_in_proj_words(arch, tuple(roll)))
    words, notes = unaligned_words(arch, tuple(whole))
    if whole != roll:
        notes = [in_proj_note(roll, whole), *notes]
    elif not words:
        return [], []
    new = f"[{','.join([*whole, *words])}]"
    return [f"++{ROLLOUT_KEY}={new}", f"++{TRAIN_KEY}={new}"], notes
