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
either engine can do.
"""

from __future__ import annotations

from typing import Any

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
        split = _split_group(side, arch)
        if split:
            r.error(key, split)


def _split_group(side: Any, arch: Any) -> str | None:
    for layer in range(arch.num_layers):
        names = {lin.kind: lin.name for lin in arch.layer_linears(layer)}
        for group in FUSED_GROUPS:
            present = [k for k in group if k in names]  # Moonlight has no q_a_proj
            kept = [k for k in present if side.keeps_bf16(names[k])]
            if kept and len(kept) < len(present):
                return (
                    f"keeps {kept} of layer {layer} BF16 but not "
                    f"{[k for k in present if k not in kept]}: vLLM runs "
                    f"{'/'.join(group)} as one fused GEMM; list all of them or none"
                )
    return None


def per_name_mismatch(linear_name: str, train: Any, rollout: Any) -> tuple | None:
    """(why, keys, fixes, severity) when only one side's per-name list keeps this linear BF16
    (the flow's mismatch shape), else None. The fix copies the other side's list: Jet-RL keeps
    the user's BF16 choice and makes training match it."""
    in_train, in_roll = train.keeps_bf16(linear_name), rollout.keeps_bf16(linear_name)
    if f".{VISION_WORD}." in linear_name and not in_roll:  # training: BF16 without a list
        return (
            f"vLLM quantizes the vision tower in an FP8 rollout unless {ROLLOUT_KEY} names "
            f"{VISION_WORD!r}; training keeps it BF16",
            (ROLLOUT_KEY,),
            (f"add {VISION_WORD!r} to {ROLLOUT_KEY}",),
            "always",
        )
    if in_train == in_roll:
        return None
    side, other = ("rollout", "training") if in_roll else ("training", "rollout")
    words = sorted(set(train.bf16_layer_kws) | set(rollout.bf16_layer_kws))
    return (
        f"the {side}'s per-name BF16 list keeps these linears BF16 while {other} runs them in "
        "FP8; both sides must keep the same linears BF16",
        (TRAIN_KEY, ROLLOUT_KEY),
        (f"{TRAIN_KEY}={words}", f"and {ROLLOUT_KEY}={words}"),
        "always",
    )
