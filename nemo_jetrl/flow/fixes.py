"""A mismatch's fixes as overrides a user can paste, and the one per-name list they name.

`Mismatch.fixes` holds config-free ``key=value`` suggestions: alternatives start with ``"or "``,
``"and "`` joins settings that go together, text that is no ``key=value`` stays as it is. Against
a loaded config (its `config.overrides.key_presence`, ``has_key``) they become overrides
`apply_overrides` accepts as given: ``key=value`` when the config has the key, ``+key=value``
when it does not (`config.overrides.setting_override`: NeMo-RL's
upstream configs have no ``jetrl:`` section, so ``jetrl.vllm_patch=true`` must be added there);
a list value is written ``[a,b]``, one shell word once quoted (`shell_line`).

Every fix that sets a per-name BF16 list names `list_fix_words`, so fixes pasted together agree,
and they start from `layer_lists.shared_bf16_words`, the list `jetrl align` writes: a word
keeping part of Megatron's fused in_proj becomes ``linear_attn.in_proj``, never a list the
check itself refuses.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from typing import Any

from nemo_jetrl.arch.linear import VISION_WORD
from nemo_jetrl.config import schema as S
from nemo_jetrl.config.layer_lists import shared_bf16_words
from nemo_jetrl.config.overrides import parse_override, setting_override

_CONNECTORS = ("or ", "and ")
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_./-]+")


def list_fix_words(arch: Any, recipe: Any, rollout_edges: Sequence[Any]) -> tuple[str, ...]:
    """The per-name BF16 list every list fix of one check names for both sides:
    `shared_bf16_words` (align's), the kinds vLLM computes in BF16 whatever the recipe says
    (`flow.vllm_bf16`) and, when the rollout quantizes the vision tower, its word."""
    words = [*shared_bf16_words(arch, recipe)]
    words += [e.kind for e in rollout_edges if e.precision.why is not None]
    if any(e.group == "vision" and e.precision.is_fp8 for e in rollout_edges):
        words.append(VISION_WORD)
    return tuple(dict.fromkeys(words))


def patch_fix(recipe: Any) -> tuple[str, ...]:
    """``jetrl.vllm_patch=true``, and ``pow2_activation_scaling_factors=false`` where the
    rollout sets it: validation refuses it beside the patch, whose activations follow the
    weights' scale rule (`config.validate._check_patch_activation_scales`)."""
    ro = recipe.rollout
    off = ro.quantizer != "jetrl" and ro.pow2_activation_scales
    return ("jetrl.vllm_patch=true", *((f"and {S.VLLM_POW2_A}=false",) if off else ()))


def scale_fix(is_weight: bool, recipe: Any, pow2: bool) -> tuple[str, ...]:
    """The rollout's weight or activation scale rule set to ``pow2``; under our patch
    activations follow the weights' key (the activations' one must stay false)."""
    patched = recipe.rollout.quantizer == "jetrl"
    key = S.VLLM_POW2_W if is_weight or patched else S.VLLM_POW2_A
    return (f"{key}={'true' if pow2 else 'false'}",)


def _value_text(raw: str, value: Any) -> str:
    """``[a,b]`` for a list of plain words (one shell word once quoted), else ``raw``."""
    if isinstance(value, list) and all(
        isinstance(v, str) and _PLAIN_WORD.fullmatch(v) for v in value
    ):
        compact = f"[{','.join(value)}]"
        if parse_override(f"k={compact}")[2] == value:
            return compact
    return raw


def paste_override(has_key: Callable[[str], bool], fix: str) -> str:
    """One ``key=value`` suggestion as the override the config accepts; other text unchanged."""
    key, eq, raw = fix.partition("=")
    key = key.strip()
    if not eq or not key or " " in key or key.startswith(("+", "~")):
        return fix
    try:
        _op, key, value = parse_override(fix)
    except ValueError:
        return fix
    return setting_override(has_key, key, _value_text(raw.strip(), value))


def fix_options(has_key: Callable[[str], bool], fixes: Sequence[str]) -> list[list[str]]:
    """The alternatives of ``fixes``, each the overrides to pass together (``"or"`` starts the
    next one; ``"and"`` is dropped)."""
    options: list[list[str]] = []
    for fix in fixes:
        start = fix.startswith("or ")
        body = next((fix[len(c) :] for c in _CONNECTORS if fix.startswith(c)), fix)
        if start or not options:
            options.append([])
        options[-1].append(paste_override(has_key, body))
    return options


def pasteable_fixes(has_key: Callable[[str], bool], fixes: Sequence[str]) -> list[str]:
    """``fixes`` in their own shape (connectors kept), each setting as the config's override."""
    out = []
    for fix in fixes:
        conn = next((c for c in _CONNECTORS if fix.startswith(c)), "")
        out.append(conn + paste_override(has_key, fix[len(conn) :]))
    return out


def shell_line(option: Sequence[str]) -> str:
    """Overrides as shell words: what a user pastes after ``jetrl check CONFIG``."""
    return " ".join(shlex.quote(o) for o in option)


def fix_text(has_key: Callable[[str], bool], fixes: Sequence[str]) -> str:
    """Every alternative on one line, ``" or "`` between them."""
    return " or ".join(shell_line(o) for o in fix_options(has_key, fixes))
