"""Keep named linears BF16 inside Megatron's FP8 region (``jetrl.train_bf16_layer_kws``).

A Jet-RL recipe may keep some decoder linears BF16 by name (NeMo-RL's rollout list,
``quantization_ignored_layer_kws``, and its training twin). Megatron-Core runs each transformer
layer inside Transformer Engine's FP8 autocast; TE decides per module call whether to quantize
(``FP8GlobalStateManager.is_fp8_enabled()`` at forward, the choice saved for backward), and the
autocast context nests. So a module runs BF16 when its forward is entered inside an autocast
with FP8 disabled: `keep_bf16_by_name` wraps exactly those modules' ``forward`` that way and
returns a handle whose ``restore()`` puts the original forwards back (idempotent).

Names. Megatron fuses HF's q/k/v into ``self_attention.linear_qkv`` and gate/up into
``mlp.linear_fc1`` (``linear_proj`` = o_proj, ``linear_fc2`` = down_proj), and numbers layers per
pipeline stage. Latent attention (megatron-core 0.16 ``MLASelfAttention``, DeepSeek-V3 and
Moonlight) keeps HF's projections apart: ``linear_q_proj`` = q_proj (no q LoRA),
``linear_q_down_proj`` / ``linear_q_up_proj`` = q_a_proj / q_b_proj, ``linear_kv_down_proj`` =
kv_a_proj_with_mqa, ``linear_kv_up_proj`` = kv_b_proj (the up projections hold the a-side
layernorm in TE's spec, as Megatron-Bridge's DeepSeek mapping has it). Routed and shared experts
(``mlp.experts.*``, ``mlp.shared_experts.*``) are not matched. A module is kept BF16 when every
HF linear it fuses (``model.layers.<global index>.self_attn.q_proj`` ...) matches a word of the
list (`nemo_jetrl.config.layer_lists` refuses lists that split a fused group).

Gated delta net (megatron-core 0.16 ``ssm.gated_delta_net.GatedDeltaNet``, Qwen3-Next/Qwen3.5
linear attention, in the ``self_attention`` slot) computes q, k, v, z, b and a in ONE
``in_proj`` GEMM (HF: Qwen3.5's in_proj_qkv/z/b/a, Qwen3-Next's in_proj_qkvz/ba); its
``out_proj`` is HF's ``linear_attn.out_proj``. A word keeps ``in_proj`` BF16 only when it names
the stem ``linear_attn.in_proj`` every part shares; a word naming some parts only is refused.

A word that names no module is refused too (it would silently do nothing), except words for
what training keeps BF16 anyway (vision tower, conv1d, lm_head, embeddings); under pipeline
parallelism "no module" means on no stage (``gather``), and without ``gather`` a word naming a
layer another stage holds is let pass.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NoReturn

from torch import nn

from nemo_jetrl.arch.hybrid import IN_PROJ_WORD, MEGATRON_IN_PROJ_GROUPS

FUSED_HF = {
    "linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "linear_proj": ("self_attn", ("o_proj",)),
    "linear_fc1": ("mlp", ("gate_proj", "up_proj")),
    "linear_fc2": ("mlp", ("down_proj",)),
    "linear_q_proj": ("self_attn", ("q_proj",)),
    "linear_q_down_proj": ("self_attn", ("q_a_proj",)),
    "linear_q_up_proj": ("self_attn", ("q_b_proj",)),
    "linear_kv_down_proj": ("self_attn", ("kv_a_proj_with_mqa",)),
    "linear_kv_up_proj": ("self_attn", ("kv_b_proj",)),
    "in_proj": ("linear_attn", ("in_proj",)),  # GatedDeltaNet: the stem of every HF part
    "out_proj": ("linear_attn", ("out_proj",)),
}
# HF parts of GatedDeltaNet's one in_proj GEMM (Qwen3.5, Qwen3-Next).
GDN_IN_PROJ_PARTS = tuple(p for g in MEGATRON_IN_PROJ_GROUPS for p in g)
# Training keeps these BF16 without a list (outside Megatron's FP8 decoder linears / not GEMMs).
# Training keeps these BF16 without a list: not Megatron FP8 decoder linears (the vision tower,
# conv1d, lm_head, embeddings; the MoE router ``mlp.gate`` and Qwen's shared_expert_gate run in
# torch outside TE).
TRAIN_BF16_ANYWAY = ("visual", "conv1d", "lm_head", "embed_tokens", "shared_expert_gate")
ROUTER_WORD_END = "mlp.gate"
_LAYER_WORD = re.compile(r"layers\.(\d+)\.")
_MEGATRON_LINEAR = re.compile(
    rf"(?:^|\.)layers\.(\d+)\.(self_attention|mlp)\.({'|'.join(FUSED_HF)})$"
)


def hf_linear_names(megatron_name: str, layer_offset: int = 0) -> list[str]:
    """HF names of the linears a Megatron decoder linear computes ([] for other modules)."""
    m = _MEGATRON_LINEAR.search(megatron_name)
    if m is None:
        return []
    layer = int(m.group(1)) + layer_offset
    block, projs = FUSED_HF[m.group(3)]
    return [f"model.layers.{layer}.{block}.{p}" for p in projs]


def te_fp8_disabled() -> AbstractContextManager[Any]:
    """Transformer Engine's autocast with FP8 off: ``autocast`` where TE has it (2.15, which
    NeMo-RL pins, warns on every call of the older ``fp8_autocast``), else ``fp8_autocast``."""
    import transformer_engine.pytorch as te

    ctx = getattr(te, "autocast", None) or te.fp8_autocast
    return ctx(enabled=False)


class Bf16NameHandle:
    """The wrapped modules of one model; `restore` puts their forwards back."""

    def __init__(self, wrapped: list[tuple[str, nn.Module]]) -> None:
        self.wrapped = wrapped
        self.active = True

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.wrapped]

    def restore(self) -> None:
        if not self.active:
            return
        for _, mod in self.wrapped:
            mod.__dict__.pop("forward", None)  # the class's forward is visible again
        self.active = False


def keep_bf16_by_name(
    model: nn.Module | Sequence[nn.Module],
    kws: Sequence[str],
    *,
    layer_offset: int = 0,
    fp8_disabled: Callable[[], AbstractContextManager[Any]] = te_fp8_disabled,
    gather: Callable[[Any], list[Any]] | None = None,
) -> Bf16NameHandle:
    """Run every Megatron decoder linear whose HF linears all match ``kws`` with FP8 off
    (``fp8_disabled()`` around its forward). ``model``: a module or NeMo-RL's list of model
    chunks; ``layer_offset``: the pipeline stage's first global layer. ValueError when a word
    matches a fused group only in part (the list cannot be applied to fused GEMMs), or matches no
    linear. ``gather``: every rank's value of an object (all-gather; called once, on every rank,
    whatever this rank found): a word is then judged over all pipeline stages, not this one (a
    stage of MoE layers has no dense ``mlp.down_proj``), and every rank raises together."""
    chunks = list(model) if isinstance(model, Sequence) else [model]
    wrapped: list[tuple[str, nn.Module]] = []
    used: set[str] = set()
    layers: set[int] = set()
    problem = None
    try:
        for chunk in chunks:
            for name, mod in chunk.named_modules():
                hf = hf_linear_names(name, layer_offset)
                if hf:
                    layers.add(int(_LAYER_WORD.search(hf[0]).group(1)))  # type: ignore[union-attr]
                if hf and hf[0].endswith(".linear_attn.in_proj"):
                    _refuse_part_of_in_proj(name, hf[0], kws)
                hits = [h for h in hf if any(kw in h for kw in kws)]
                used.update(kw for kw in kws if any(kw in h for h in hf))
                if not hits:
                    continue
                if len(hits) < len(hf):
                    raise ValueError(
                        f"{name} computes {hf} as one GEMM but the BF16 list {list(kws)} names "
                        f"only {hits}: list all of them or none (jetrl.train_bf16_layer_kws)"
                    )
                _wrap(mod, fp8_disabled)
                wrapped.append((name, mod))
    except Exception as exc:  # raised after the gather: no rank is left waiting in it
        problem = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    parts = gather((sorted(used), sorted(layers), problem)) if gather else [(used, layers, problem)]
    used = {kw for u, _, _ in parts for kw in u}
    # every stage answered: a word naming any layer must have matched (a typo'd index too)
    unused = [kw for kw in kws if kw not in used and _should_match(kw, None if gather else layers)]
    problems = [p for _, _, p in parts if p]
    if unused:
        problems.append(
            f"jetrl.train_bf16_layer_kws: {unused} match no Megatron linear of this model "
            "(decoder linears: linear_qkv/linear_proj/linear_fc1/linear_fc2, MLA projections, "
            "gated delta net in_proj/out_proj): training would run them in FP8 unnoticed; "
            "remove them or name a linear the model has"
        )
    if problems:
        for _, mod in wrapped:
            mod.__dict__.pop("forward", None)
        raise ValueError(problems[0])
    return Bf16NameHandle(wrapped)


def refuse_with_ranks(problem: str, gather: Callable[[Any], list[Any]]) -> NoReturn:
    """Raise ``problem`` found on this rank before `keep_bf16_by_name` (its KV hooks, say),
    after entering the gather the other ranks' `keep_bf16_by_name` waits in: they raise it too."""
    gather(([], [], problem))
    raise ValueError(problem)


def _refuse_part_of_in_proj(name: str, stem: str, kws: Sequence[str]) -> None:
    """GatedDeltaNet's in_proj is one GEMM: a word naming some of its HF parts cannot apply."""
    if any(kw in stem for kw in kws):
        return
    parts = [
        kw for kw in kws if any(kw in f"{stem}{p[len('in_proj') :]}" for p in GDN_IN_PROJ_PARTS)
    ]
    if parts:
        raise ValueError(
            f"jetrl.train_bf16_layer_kws: {parts} name part of {name}, which megatron-core "
            f"computes as one GEMM (q, k, v, z, b, a): use {IN_PROJ_WORD!r} in both "
            "jetrl.train_bf16_layer_kws and policy.generation.vllm_cfg."
            "quantization_ignored_layer_kws (vLLM's in_proj_qkvz + in_proj_ba) or neither"
        )


def _should_match(kw: str, layers: set[int] | None) -> bool:
    """False for words training keeps BF16 anyway and words naming a layer outside ``layers``
    (this stage's; None: every stage was asked)."""
    if any(a in kw for a in TRAIN_BF16_ANYWAY) or kw.endswith(ROUTER_WORD_END):
        return False
    m = _LAYER_WORD.search(kw)
    return m is None or not layers or int(m.group(1)) in layers


def _wrap(mod: nn.Module, fp8_disabled: Callable[[], AbstractContextManager[Any]]) -> None:
    inner = type(mod).forward.__get__(mod)

    def forward(*args: Any, **kwargs: Any) -> Any:
        with fp8_disabled():
            return inner(*args, **kwargs)

    mod.forward = forward  # instance attribute: nn.Module.__call__ finds it first
