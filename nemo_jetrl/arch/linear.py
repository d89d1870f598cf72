"""One linear layer of a model, the unit a recipe decides FP8 for, and the error of a bad model
description. Every family (`dense`, `moe`, `mla`, `hybrid`) lists its layers as `Linear`s.

A linear belongs to one *group*, the row `jetrl check` gives a verdict for:

    attn            q/k/v/o of full attention (DeepSeek's MLA projections too)
    mlp             a dense MLP (every layer of a dense model, the dense layers of an MoE model)
    experts         routed experts, fused 3-D as transformers 5 stores them [E, out, in]
    router          the MoE router `mlp.gate`: BF16/FP32 on both sides, never FP8
    shared_experts  experts every token passes through (`shared_expert(s)`, `shared_expert_gate`)
    linear_attn     gated linear attention (Qwen3-Next / Qwen3.5 `linear_attn.*`)
    mamba           Nemotron-H's Mamba-2 mixers (`mixer.in_proj`, `conv1d`, `out_proj`)
    moe_latent      projections into and out of the experts' latent space (Nemotron 3 Super)
    vision          the vision tower (`visual`): BF16 in training; BF16 in the rollout when
                    its per-name list names "visual" (vLLM quantizes it otherwise)
    embed_tokens, lm_head   always BF16

`bf16_why` marks what a recipe's decoder FP8 never reaches (the router, a depthwise
convolution, the vision tower), so the flow draws it BF16 and says why; the vision tower is
the one exception in the rollout (see `VISION_BF16`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from nemo_jetrl.fp8.spec import BLOCK, linear_dims_problem

# Per-layer linears in execution order, with the HF module path under `model.layers.{i}.`.
ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
LAYER_GROUP = MappingProxyType(
    {**{n: "attn" for n in ATTN_LINEARS}, **{n: "mlp" for n in MLP_LINEARS}}
)
GROUPS = (
    "embed_tokens",
    "attn",
    "linear_attn",
    "mamba",
    "mlp",
    "router",
    "moe_latent",
    "experts",
    "shared_experts",
    "vision",
    "lm_head",
)
"""Every group, in the order `jetrl check` prints them."""

ROUTER_BF16 = "the MoE router stays BF16/FP32 on both sides (never FP8)"
CONV_BF16 = "a depthwise convolution, not a GEMM: no FP8 kernel on either side"
VISION_WORD = "visual"
"""The vision tower's module name (`model.visual`), the word NeMo-RL lists to keep it BF16."""
VISION_BF16 = (
    "the vision tower: BF16 in training (outside the decoder's FP8 linears); vLLM passes its "
    f"quant_config to the tower, so the rollout keeps it BF16 only when its per-name list "
    f"names {VISION_WORD!r}"
)


# How vLLM (0.33 deepseek_v2.py, qwen3_next.py, llama.py) shards a decoder linear over
# tensor-parallel ranks: replicated (every rank holds it whole), row-parallel (input columns
# split), else column-parallel (output rows split; merged q/k/v, gate/up, in_proj_qkvz/ba too).
VLLM_REPLICATED = frozenset({"q_a_proj", "kv_a_proj_with_mqa"})
VLLM_ROW_PARALLEL = frozenset({"o_proj", "down_proj", "out_proj"})


class ArchError(ValueError):
    """A model description that cannot be read; `key` names the config key to fix."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Linear:
    """One linear layer (torch layout: weight [out_features, in_features])."""

    name: str
    """Full HF parameter prefix, e.g. "model.layers.3.self_attn.q_proj"."""

    kind: str
    """Short name, e.g. "q_proj" or "lm_head"."""

    layer: int | None
    """Decoder layer index, or None for embeddings / lm_head / the vision tower."""

    in_features: int
    """GEMM reduction dim K (input features; a depthwise conv's kernel width)."""

    out_features: int
    """GEMM output dim N (output features; a depthwise conv's channels)."""

    bias: bool = False
    """The layer has a bias vector (Qwen2's q/k/v)."""

    group: str = ""
    """The group (module docstring); empty: from `kind` (attn / mlp / the kind itself)."""

    experts: int = 0
    """Routed experts stored as one 3-D tensor [experts, out, in]; 0 for a 2-D weight."""

    bf16_why: str | None = None
    """Why this layer never runs FP8 (router, convolution, vision tower); None: the recipe
    decides."""

    vllm_bf16_why: str | None = None
    """Why vLLM's rollout multiplies by this weight in BF16 whatever the recipe says (DeepSeek
    MLA decode's absorbed kv_b_proj: `arch.mla.KV_B_ABSORBED`); the flow draws its rollout edges
    BF16 on a vLLM rollout where the side would run it FP8. None: the recipe decides."""

    kernel: tuple[int, ...] = ()
    """A convolution's kernel dims (weight [out, in per group, *kernel]); () for a linear."""

    embedding: bool = False
    """A lookup table [in_features rows, out_features dims] (the vision tower's pos_embed)."""

    def __post_init__(self) -> None:
        if not self.group:
            object.__setattr__(self, "group", LAYER_GROUP.get(self.kind, self.kind))

    @property
    def aligned(self) -> bool:
        """Both dims are multiples of 128, so blockwise FP8 tiles the weight exactly (each
        expert's own [out, in] matrix for fused experts)."""
        return self.in_features % BLOCK == 0 and self.out_features % BLOCK == 0

    def fits(self, scaling: str = "blockwise") -> bool:
        """FP8 of ``scaling`` runs this shape on both sides. Blockwise: a linear's dims pass TE's
        FP8 GEMM rule (`spec.linear_dims_problem`); partial 128-blocks run (TE's quantizers and
        vLLM's block-FP8 linear take ceil-sized scale grids). Fused experts and MXFP8 keep
        `aligned` (each expert's blocks stack; MXFP8 not reviewed for tails)."""
        if scaling != "blockwise" or self.group == "experts" or self.experts:
            return self.aligned
        return linear_dims_problem(self.in_features, self.out_features) is None

    def vllm_tp_problem(self, tp: int) -> str | None:
        """Why vLLM's ``tensor_parallel_size=tp`` splits this block-FP8 linear off a 128-block
        edge (its loader then refuses it, or each rank re-blocks its slice: not training's
        blocks); None where every rank's slice starts on a block edge. Asked of partial-block
        linears (the 128-multiple ones: `flow.support`, the loaders)."""
        if tp <= 1 or self.aligned or self.kind in VLLM_REPLICATED or self.group == "experts":
            return None
        row = self.kind in VLLM_ROW_PARALLEL
        width = self.in_features if row else self.out_features
        if width % (BLOCK * tp) == 0:
            return None
        what = "input columns" if row else "output rows"
        return (
            f"vLLM tensor_parallel_size={tp} splits its {width} {what} into {width / tp:g} per "
            f"rank, off a {BLOCK}-block edge"
        )

    @property
    def fp8_capable(self) -> bool:
        """A recipe may run it FP8 (not the router, a convolution or the vision tower)."""
        return self.bf16_why is None and self.group not in ("embed_tokens", "lm_head")

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """The weight tensor's shape as torch stores it."""
        if self.embedding:
            return (self.in_features, self.out_features)
        if self.kernel:
            return (self.out_features, self.in_features, *self.kernel)
        if self.experts:
            return (self.experts, self.out_features, self.in_features)
        return (self.out_features, self.in_features)

    @property
    def numel(self) -> int:
        """Weight elements plus bias."""
        n = 1
        for d in self.weight_shape:
            n *= d
        return n + (self.out_features * max(self.experts, 1) if self.bias else 0)
