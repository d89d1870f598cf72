"""The precision-flow graph: which tensor enters which op in which precision, per phase.

One edge per tensor flowing into an op (a linear's GEMM, the KV cache), carrying a `Precision`:
dtype, FP8 format, block shape, scale mode and the implementation that quantizes it. Phases:

- ``rollout``: the inference engine's forward;
- ``train_fwd``: the training forward (what the policy being optimised computes);
- ``train_bwd``: the training backward: DGrad takes dY in 1x128 groups and reuses the forward's
  128x128 weight blocks transposed (no requantization); WGrad takes dY and x in 128x1 blocks
  (128 tokens per block); ``hybrid`` makes gradients E5M2.

Edges come from *builders*, functions ``(arch, recipe, phase) -> list[Edge]``; `build_flow`
runs `DEFAULT_BUILDERS` (embeddings/lm_head, decoder linears, K/V) or any tuple you pass, so new
edge kinds plug in without editing this module. The comparison lives in `nemo_jetrl.flow.check`.

The rollout engine: `DEFAULT_BUILDERS` draw vLLM's rollout (what a recipe's rollout keys set;
NeMo-RL's Megatron generation, a rollout quantizer "te", runs the training model instead).
Where vLLM computes a linear's product in BF16 whatever the recipe says (`Linear.vllm_bf16_why`:
DeepSeek MLA decode's absorbed kv_b_proj), its rollout edges are BF16 with that reason.
`HF_ROLLOUT_BUILDERS` draw the local backend's HF rollout (``jetrl.local.rollout_engine: hf``),
whose FP8 linears run every product as the recipe says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from nemo_jetrl.arch import ModelArch
from nemo_jetrl.recipe import Recipe
from nemo_jetrl.recipe_parts import QUANTIZER_FORMULA, SideRecipe

Phase = Literal["rollout", "train_fwd", "train_bwd"]
PHASES: tuple[str, ...] = ("rollout", "train_fwd", "train_bwd")

BLOCK_1x128 = (1, 128)
BLOCK_128x128 = (128, 128)
BLOCK_128x1 = (128, 1)
BLOCK_MX = (1, 32)


@dataclass(frozen=True)
class Precision:
    """What a tensor looks like on an edge."""

    dtype: str
    """Numeric kind: "bf16" or "fp8"."""

    fmt: str | None = None
    """FP8 element format ("e4m3"/"e5m2"); None for BF16."""

    block: tuple[int, int] | None = None
    """Scaling block (rows, cols) of the 2-D operand; None for per-tensor or BF16."""

    scale: str | None = None
    """Scale rule: "pow2", "fp32", "e8m0" for block scales; for per-tensor KV the scale source
    ("trainer_calibrated", "checkpoint", "dynamic", "unit"); None for BF16."""

    impl: str | None = None
    """Code that quantizes: "te", "jetrl", "vllm"; None for BF16."""

    why: str | None = field(default=None, compare=False)
    """Why the engine runs this edge BF16 against the recipe (`Linear.vllm_bf16_why`); not part
    of the numbers."""

    @property
    def is_fp8(self) -> bool:
        return self.dtype == "fp8"

    def short(self) -> str:
        """Compact text, e.g. "FP8 e4m3 1x128 pow2 [te]"."""
        block = f"{self.block[0]}x{self.block[1]}" if self.block else "per-tensor"
        if not self.is_fp8:
            if self.fmt is None:
                return "BF16"
            return f"BF16 dequantized from FP8 {self.fmt} {block} {self.scale} [{self.impl}]"
        return f"FP8 {self.fmt} {block} {self.scale} [{self.impl}]"


BF16 = Precision("bf16")

# Per-tensor KV quantization has one semantics on both sides (vLLM's cache write: x / scale,
# saturating RNE cast), implemented by vLLM in rollout and by nemo_jetrl.kvcache in training.
_KV_SCALES = ("trainer_calibrated", "checkpoint", "dynamic", "unit")


def formula(p: Precision) -> str | None:
    """Which quantization formula produces this edge's numbers (None for BF16)."""
    if not p.is_fp8:
        return None
    if p.block is None and p.scale in _KV_SCALES:
        return "kv_per_tensor"
    return QUANTIZER_FORMULA.get(p.impl or "", p.impl)


def same_numbers(a: Precision, b: Precision) -> bool:
    """True when two edges carry bit-identical tensors for the same input: same dtype, format,
    block and scale rule, computed by implementations of the same formula."""
    return (a.dtype, a.fmt, a.block, a.scale) == (b.dtype, b.fmt, b.block, b.scale) and formula(
        a
    ) == formula(b)


@dataclass(frozen=True)
class Edge:
    """A tensor flowing into an op."""

    op: str
    """The op (node) the tensor flows into, e.g. "model.layers.3.self_attn.q_proj"."""

    role: str
    """Which operand: "weight", "input", "dgrad.grad_output", "dgrad.weight", "wgrad.grad_output",
    "wgrad.input", "k_cache", "v_cache"."""

    layer: int | None
    """Decoder layer, or None for embeddings / lm_head."""

    group: str
    """Row label of the flow table: "attn", "mlp", "kv", "embed", "lm_head"."""

    kind: str
    """Module kind, e.g. "q_proj" or "attn"."""

    precision: Precision
    """Precision of the tensor on this edge."""

    @property
    def key(self) -> tuple[str, str]:
        """Identity of the edge across phases."""
        return (self.op, self.role)

    @property
    def source(self) -> str:
        """The node the tensor comes from: the weight itself, or the previous activation."""
        return f"{self.op}.weight" if self.role.endswith("weight") else f"{self.op}:{self.role}"


@dataclass(frozen=True)
class PrecisionFlow:
    """All edges of one phase of a model under a recipe."""

    phase: str
    """Phase: "rollout", "train_fwd" or "train_bwd"."""

    model: str
    """Model name."""

    recipe: str
    """Recipe name."""

    edges: tuple[Edge, ...]
    """The edges, in model order."""

    def by_key(self) -> dict[tuple[str, str], Edge]:
        return {e.key: e for e in self.edges}

    def nodes(self) -> list[str]:
        """Weights and ops (graph nodes), in model order."""
        seen: dict[str, None] = {}
        for e in self.edges:
            seen.setdefault(e.source, None)
            seen.setdefault(e.op, None)
        return list(seen)


EdgeBuilder = Callable[[ModelArch, Recipe, str], "list[Edge]"]


# ---------------------------------------------------------------------------------------------
# builders


def _linear_is_fp8(
    side: SideRecipe, recipe: Recipe, layer: int, n: int, aligned: bool, name: str
) -> bool:
    if not side.is_fp8_linear(name, layer, n):
        return False
    # Unaligned linears stay BF16 on both sides when configured; otherwise the config is invalid
    # (validation says so) and we still draw what was asked for.
    return aligned or not recipe.unaligned_layers_bf16


def _fwd_precisions(side: SideRecipe, impl: str) -> tuple[Precision, Precision]:
    """(weight, input) precision of an FP8 linear's forward on one side."""
    if side.scaling == "mxfp8":
        return (
            Precision("fp8", "e4m3", BLOCK_MX, "e8m0", impl),
            Precision("fp8", "e4m3", BLOCK_MX, "e8m0", impl),
        )
    if side.scaling in ("tensorwise", "delayed"):
        return (
            Precision("fp8", "e4m3", None, side.scaling, impl),
            Precision("fp8", "e4m3", None, side.scaling, impl),
        )
    return (
        Precision("fp8", "e4m3", BLOCK_128x128, side.scale_mode("weight"), impl),
        Precision("fp8", "e4m3", BLOCK_1x128, side.scale_mode("activation"), impl),
    )


ROLLOUT_ENGINES = ("vllm", "hf")
"""Rollout engines the flow draws: vLLM (NeMo-RL, ``jetrl.local.rollout_engine: vllm``) and the
local backend's HF model with our FP8 linears (``hf``)."""


def _vllm_bf16(lin, w_fp8: Precision) -> tuple[Precision, Precision]:
    """(weight, input) of a linear whose product vLLM takes in BF16 (`Linear.vllm_bf16_why`): the
    weight is the FP8 one dequantized to BF16 (fmt/block/scale kept: not the BF16 master
    weight), the input is never quantized."""
    why = lin.vllm_bf16_why
    weight = Precision("bf16", w_fp8.fmt, w_fp8.block, w_fp8.scale, w_fp8.impl, why=why)
    return weight, Precision("bf16", why=why)


def linear_edges(
    arch: ModelArch, recipe: Recipe, phase: str, rollout_engine: str = "vllm"
) -> list[Edge]:
    """Edges into every decoder linear (weight and input; backward operands for train_bwd).
    ``rollout_engine`` (`ROLLOUT_ENGINES`): which engine the rollout phase runs on."""
    if rollout_engine not in ROLLOUT_ENGINES:
        raise ValueError(f"rollout_engine must be one of {ROLLOUT_ENGINES}, got {rollout_engine!r}")
    side = recipe.rollout if phase == "rollout" else recipe.train
    # vLLM's own computation, unless the rollout runs the training model (NeMo-RL's Megatron
    # generation: rollout quantizer "te") or the local HF model
    on_vllm = phase == "rollout" and rollout_engine == "vllm" and side.quantizer != "te"
    n = arch.num_layers
    out: list[Edge] = []
    for layer in range(n):
        for lin in arch.layer_linears(layer):
            fits = lin.fits(side.scaling)
            fp8 = lin.fp8_capable and _linear_is_fp8(side, recipe, layer, n, fits, lin.name)
            grp = lin.group
            # Experts follow the side's quantizer like every linear: our vLLM patch runs its
            # experts kernel under a Jet-RL recipe (the releases it covers: flow.backend).
            impl = side.quantizer

            def add(role: str, p: Precision, lin=lin, grp=grp) -> None:
                out.append(Edge(lin.name, role, lin.layer, grp, lin.kind, p))

            if phase in ("rollout", "train_fwd"):
                w, x = _fwd_precisions(side, impl) if fp8 else (BF16, BF16)
                if fp8 and on_vllm and lin.vllm_bf16_why:
                    w, x = _vllm_bf16(lin, w)
                add("weight", w)
                add("input", x)
                continue
            if not fp8:
                for role in (
                    "dgrad.grad_output",
                    "dgrad.weight",
                    "wgrad.grad_output",
                    "wgrad.input",
                ):
                    add(role, BF16)
                continue
            gfmt = "e5m2" if side.fmt == "hybrid" else "e4m3"
            w_fwd, _ = _fwd_precisions(side, side.quantizer)
            a_scale = side.scale_mode("activation")
            block = side.scaling == "blockwise"
            add(
                "dgrad.grad_output",
                Precision(
                    "fp8", gfmt, BLOCK_1x128 if block else w_fwd.block, a_scale, side.quantizer
                ),
            )
            add("dgrad.weight", w_fwd)  # same 128x128 blocks, transposed: no requantization
            add(
                "wgrad.grad_output",
                Precision(
                    "fp8", gfmt, BLOCK_128x1 if block else w_fwd.block, a_scale, side.quantizer
                ),
            )
            add(
                "wgrad.input",
                Precision(
                    "fp8", "e4m3", BLOCK_128x1 if block else w_fwd.block, a_scale, side.quantizer
                ),
            )
    return out


def bf16_edges(arch: ModelArch, recipe: Recipe, phase: str) -> list[Edge]:
    """Embedding lookup and lm_head: BF16 on every side, always; the vision tower: BF16 in
    training, FP8 in an FP8 rollout unless its per-name list keeps it (`arch.linear`)."""
    roles = ("weight", "input") if phase != "train_bwd" else ("dgrad.grad_output",)
    out = [Edge(f"{arch.prefix}.embed_tokens", "weight", None, "embed", "embed_tokens", BF16)]
    out += [Edge("lm_head", r, None, "lm_head", "lm_head", BF16) for r in roles]
    if phase == "train_bwd":
        return out[1:]
    side = recipe.rollout
    for lin in arch.nondecoder_linears():
        # The vision tower: BF16 in training; vLLM quantizes it unless the list names it.
        fp8 = phase == "rollout" and side.fp8_linears and not side.keeps_bf16(lin.name)
        w, x = _fwd_precisions(side, side.quantizer) if fp8 else (BF16, BF16)
        out += [Edge(lin.name, "weight", None, lin.group, lin.kind, w)]
        out += [Edge(lin.name, "input", None, lin.group, lin.kind, x)]
    return out


def kv_edges(arch: ModelArch, recipe: Recipe, phase: str) -> list[Edge]:
    """K and V entering the attention (rollout: the KV cache write/read).

    Rollout: FP8 E4M3 per-tensor when the KV cache is FP8, scales from `kv_scale_source`, written
    by vLLM's cache kernels. Training forward: BF16, unless on-policy KV makes the trainer's
    attention apply the same per-tensor quantization (nemo_jetrl.kvcache, vLLM's cache semantics)
    with the trainer-calibrated scales it sends to the rollout.
    """
    if phase == "train_bwd":
        return []
    if phase == "rollout":
        p = (
            Precision("fp8", "e4m3", None, recipe.kv_scale_source, "vllm")
            if recipe.kv_fp8
            else BF16
        )
    elif recipe.onpolicy_kv and recipe.kv_fp8:
        # The trainer uses the scales it calibrates (or 1.0): it cannot know scales vLLM computes
        # itself ("dynamic") or reads from a checkpoint the trainer never loads.
        src = recipe.kv_scale_source
        known = src in ("trainer_calibrated", "unit")
        p = Precision("fp8", "e4m3", None, src if known else "trainer_calibrated", "jetrl")
    else:
        p = BF16
    out = []
    for layer in arch.kv_layers():  # linear-attention layers keep a recurrent state, no cache
        op = f"{arch.prefix}.layers.{layer}.self_attn.attn"
        out.append(Edge(op, "k_cache", layer, "kv", "attn", p))
        out.append(Edge(op, "v_cache", layer, "kv", "attn", p))
    return out


def hf_linear_edges(arch: ModelArch, recipe: Recipe, phase: str) -> list[Edge]:
    """`linear_edges` with the rollout on the local backend's HF model."""
    return linear_edges(arch, recipe, phase, rollout_engine="hf")


MLA_KV_WHY = (
    "vLLM's MLA cache holds the compressed latent and the rotary key (one k_scale), while the "
    "trainer's attention sees per-head K/V after kv_b_proj: no trainer-side quantization can "
    "match it, and scales calibrated on per-head K/V would be other numbers"
)


def vllm_kv_edges(arch: ModelArch, recipe: Recipe, phase: str) -> list[Edge]:
    """`kv_edges` for a vLLM rollout: an FP8 cache of latent attention (MLA) has no trainer side."""
    out = kv_edges(arch, recipe, phase)
    if arch.mla is None or phase != "train_fwd" or not recipe.kv_fp8:
        return out
    return [dataclasses.replace(e, precision=Precision("bf16", why=MLA_KV_WHY)) for e in out]


DEFAULT_BUILDERS: tuple[EdgeBuilder, ...] = (bf16_edges, linear_edges, vllm_kv_edges)
HF_ROLLOUT_BUILDERS: tuple[EdgeBuilder, ...] = (bf16_edges, hf_linear_edges, kv_edges)


def build_flow(
    arch: ModelArch,
    recipe: Recipe,
    phase: str,
    builders: Sequence[EdgeBuilder] = DEFAULT_BUILDERS,
) -> PrecisionFlow:
    """The precision flow of `arch` under `recipe` for one phase."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    edges: list[Edge] = []
    for b in builders:
        edges.extend(b(arch, recipe, phase))
    return PrecisionFlow(phase, arch.name, recipe.name, tuple(edges))
