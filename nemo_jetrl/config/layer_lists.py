"""Per-name BF16 layer lists: one home for their keys, reading and checks.

NeMo-RL keeps named linears BF16 in the rollout with
``policy.generation.vllm_cfg.quantization_ignored_layer_kws`` (a linear whose HF name contains
one of the words, e.g. ``q_proj``, is left out of vLLM's FP8 quantization). Jet-RL only needs the
training side to keep the same linears BF16: ``jetrl.train_bf16_layer_kws`` is that list for
Megatron (same matching rule). Both land in `SideRecipe.bf16_layer_kws`; the flow compares the
sides linear by linear.

Two checks, both errors naming the key: a word must match at least one decoder linear of the
model (a word naming something the flow does not draw, such as a linear-attention or vision
projection, cannot be checked), and a list must keep each fused group whole: vLLM and Megatron
run q/k/v and gate/up as one GEMM each, so keeping q_proj BF16 but not k_proj is not something
either engine can do. Megatron fuses more than vLLM: its GatedDeltaNet computes Qwen3.5's
in_proj_qkv/z/b/a (Qwen3-Next's in_proj_qkvz/ba) as one in_proj GEMM, so a word keeping part of
it BF16 is refused in the training list and reported in the rollout list (vLLM can run it; the
flow names the mismatch with training, exit 1); the word true on both sides is
``linear_attn.in_proj`` (`whole_in_proj_words` rewrites a list to it).
"""

from __future__ import annotations

from typing import Any

from nemo_jetrl.arch.hybrid import IN_PROJ_WORD, MEGATRON_IN_PROJ_GROUPS
from nemo_jetrl.arch.linear import VISION_WORD
from nemo_jetrl.config import schema as S

ROLLOUT_KEY = S.VLLM_IGNORED_KWS
TRAIN_KEY = "jetrl.train_bf16_layer_kws"
# Linears vLLM loads as one GEMM (its packed_modules_mapping / fused modules): a per-name list
# keeps all of a group BF16 or none. DeepSeek MLA: fused_qkv_a_proj; Qwen3.5 linear attention:
# in_proj_qkvz and in_proj_ba.
FUSED_GROUPS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("in_proj_qkv", "in_proj_z"),
    ("in_proj_b", "in_proj_a"),
)


def read_kws(r: Any, key: str) -> tuple[str, ...]:
    """The list at ``key`` (absent, null or malformed: empty; the typed schema names a malformed
    one)."""
    value = r.get(key, None)
    if isinstance(value, list) and all(isinstance(k, str) and k for k in value):
        return tuple(value)
    return ()


def check_layer_lists(r: Any, recipe: Any, arch: Any) -> None:
    """Every word matches a decoder linear of ``arch``; fused groups are kept whole."""
    if recipe.train.bf16_layer_kws and recipe.train.fp8_param:
        r.error(
            TRAIN_KEY,
            f"needs {S.FP8_PARAM}=false: with FP8 primary weights TE holds those linears' weights "
            "in FP8 and cannot run them in BF16",
        )
    for key, side in ((TRAIN_KEY, recipe.train), (ROLLOUT_KEY, recipe.rollout)):
        if not side.bf16_layer_kws:
            continue
        linears = [*arch.linears()]  # decoder, vision tower, lm_head
        unmatched = [kw for kw in side.bf16_layer_kws if not any(kw in x.name for x in linears)]
        if unmatched:
            r.error(
                key,
                f"{unmatched} match no decoder linear of {arch.name} nor its vision tower "
                f"(names like {linears[0].name}); the precision flow has no layer these words "
                "name, so it cannot check them",
            )
        for split, megatron in _split_groups(side, arch):
            if megatron and key == ROLLOUT_KEY:
                # vLLM can do it (in_proj_ba is its own GEMM); training cannot match it: a
                # mismatch the flow reports by layer (exit 1), not an invalid list
                r.warn(key, split + "; as given, training runs the whole in_proj in FP8")
            else:
                r.error(key, split)


def _split_groups(side: Any, arch: Any) -> list[tuple[str, bool]]:
    """The first fused group split by ``side``'s list in vLLM, then in Megatron (at most one
    message each; True for Megatron's)."""
    out: list[tuple[str, bool]] = []
    for groups, who in ((FUSED_GROUPS, "vllm"), (MEGATRON_IN_PROJ_GROUPS, "megatron")):
        hit = _first_split(side, arch, groups)
        if hit is None:
            continue
        layer, group, kept, rest = hit
        if who == "vllm":
            out.append(
                (
                    f"keeps {kept} of layer {layer} BF16 but not {rest}: vLLM runs "
                    f"{'/'.join(group)} as one fused GEMM; list all of them or none",
                    False,
                )
            )
        else:
            out.append(
                (
                    f"keeps {kept} of layer {layer} BF16 but not {rest}: megatron-core's "
                    f"GatedDeltaNet computes {'/'.join(group)} as one in_proj GEMM, so training "
                    f"cannot keep part of it BF16; use {IN_PROJ_WORD!r} (vLLM's in_proj_qkvz + "
                    f"in_proj_ba, Megatron's in_proj) in both {ROLLOUT_KEY} and {TRAIN_KEY}, or "
                    "neither",
                    True,
                )
            )
    return out


def _first_split(side: Any, arch: Any, groups: tuple) -> tuple | None:
    for layer in range(arch.num_layers):
        names = {lin.kind: lin.name for lin in arch.layer_linears(layer)}
        for group in groups:
            present = [k for k in group if k in names]  # Moonlight has no q_a_proj
            kept = [k for k in present if side.keeps_bf16(names[k])]
            if kept and len(kept) < len(present):
                return layer, present, kept, [k for k in present if k not in kept]
    return None


def bf16_words_for(arch: Any, kinds: list[str]) -> list[str]:
    """Per-name words keeping linears of these kinds BF16 that both engines can apply: a part
    of Megatron's fused in_proj becomes ``linear_attn.in_proj``; a vLLM fused group's partners
    present in ``arch`` come along."""
    parts = {p for g in MEGATRON_IN_PROJ_GROUPS for p in g}
    present = {x.kind for i in range(arch.num_layers) for x in arch.layer_linears(i)}
    words: list[str] = []
    for kind in kinds:
        if kind in parts:
            words.append(IN_PROJ_WORD)
            continue
        group = next((g for g in FUSED_GROUPS if kind in g), (kind,))
        words += [k for k in group if k in present or k == kind]
    return list(dict.fromkeys(words))


def whole_in_proj_words(arch: Any, kws: tuple[str, ...]) -> tuple[str, ...]:
    """``kws`` with every word that keeps part of a Megatron-fused in_proj BF16 replaced by
    ``linear_attn.in_proj`` (the whole projection on both sides); unchanged otherwise."""
    if arch is None or getattr(arch, "hybrid", None) is None:
        return kws
    parts = {p for g in MEGATRON_IN_PROJ_GROUPS for p in g}
    layer = next(i for i in range(arch.num_layers) if arch.hybrid.is_linear(i))
    names = [x.name for x in arch.layer_linears(layer) if x.kind in parts]
    partial = [k for k in kws if any(k in n for n in names) and not all(k in n for n in names)]
    if not partial:
        return kws
    return tuple(dict.fromkeys(IN_PROJ_WORD if k in partial else k for k in kws))


def shared_bf16_words(arch: Any, recipe: Any) -> tuple[str, ...]:
    """The per-name BF16 list both sides can share: either side's words (first seen first), a
    word keeping part of Megatron's fused in_proj made ``linear_attn.in_proj``
    (`whole_in_proj_words`). What `jetrl align` starts both lists from, and what the check's
    list fixes name (`flow.fixes.list_fix_words`)."""
    return whole_in_proj_words(arch, recipe.bf16_layer_kws())


def list_fix(train: Any, words: tuple[str, ...], *, rollout_only: bool = False) -> tuple:
    """The fix setting both lists (or the rollout's) to ``words``; with FP8 primary weights,
    which `check_layer_lists` refuses beside a training list, also ``fp8_param=false``."""
    if rollout_only:
        return (f"{ROLLOUT_KEY}={list(words)}",)
    fp8_param = (f"{S.FP8_PARAM}=false",) if train.fp8_param and words else ()
    return (f"{TRAIN_KEY}={list(words)}", f"and {ROLLOUT_KEY}={list(words)}", *fp8_param)


def per_name_mismatch(
    linear_name: str, train: Any, rollout: Any, words: tuple[str, ...] | None = None
) -> tuple | None:
    """(why, keys, fixes, severity) when only one side's per-name list keeps this linear BF16
    (the flow's mismatch shape), else None. The fix sets the lists to ``words`` (the flow's
    `flow.fixes.list_fix_words`; default: both sides' words): Jet-RL keeps the user's BF16
    choice and makes training match it."""
    in_train, in_roll = train.keeps_bf16(linear_name), rollout.keeps_bf16(linear_name)
    if words is None:
        words = tuple(dict.fromkeys((*train.bf16_layer_kws, *rollout.bf16_layer_kws)))
    if f".{VISION_WORD}." in linear_name and not in_roll:  # training: BF16 without a list
        return (
            f"vLLM quantizes the vision tower in an FP8 rollout unless {ROLLOUT_KEY} names "
            f"{VISION_WORD!r}; training keeps it BF16",
            (ROLLOUT_KEY,),
            list_fix(train, tuple(dict.fromkeys((*words, VISION_WORD))), rollout_only=True),
            "always",
        )
    if in_train == in_roll:
        return None
    side, other = ("rollout", "training") if in_roll else ("training", "rollout")
    return (
        f"the {side}'s per-name BF16 list keeps these linears BF16 while {other} runs them in "
        "FP8; both sides must keep the same linears BF16",
        (TRAIN_KEY, ROLLOUT_KEY),
        list_fix(train, words),
        "always",
    )
