"""The hybrid family (Qwen3-Next, Qwen3.5): gated linear attention beside full attention, and
the vision tower of the multimodal checkpoints.

`layer_types` names each decoder layer's token mixer, "linear_attention" or "full_attention"
(absent: every `full_attention_interval`-th layer, default 4, is full attention). A linear-
attention layer (`linear_attn.`, a gated delta net) has, with kd = linear_num_key_heads *
linear_key_head_dim, vd = linear_num_value_heads * linear_value_head_dim, nv =
linear_num_value_heads:

    qwen3_next:  in_proj_qkvz [2*kd + 2*vd, hidden]   in_proj_ba [2*nv, hidden]
    qwen3_5:     in_proj_qkv [2*kd + vd, hidden]  in_proj_z [vd, hidden]  in_proj_b, in_proj_a [nv, hidden]
    both:        conv1d (depthwise, [2*kd + vd, 1, linear_conv_kernel_dim])   out_proj [hidden, vd]

(`dt_bias`, `A_log` and the gated norm are per-head vectors, not linears.) Full-attention
layers are the dense family's, with an output gate (q_proj twice as wide).

The vision tower (`model.visual`, from `vision_config`) is BF16 in training (Megatron's
decoder FP8 does not reach it); vLLM hands the tower its quant_config, so the rollout keeps it
BF16 only when `quantization_ignored_layer_kws` names "visual" (NeMo-RL's Qwen3.5 configs do).
Its layers:
`patch_embed.proj` (Conv3d), `pos_embed`, per block `attn.qkv`, `attn.proj`,
`mlp.linear_fc1/2`, then `merger.linear_fc1/2`.
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_jetrl.arch.keys import Keys
from nemo_jetrl.arch.linear import CONV_BF16, VISION_BF16, VISION_WORD, Linear

LAYER_TYPES = ("linear_attention", "full_attention")
# megatron-core 0.16's GatedDeltaNet computes every in_proj part (q, k, v, z, b, a) as ONE
# ``in_proj`` GEMM, where vLLM runs two (in_proj_qkvz, in_proj_ba): a per-name list keeps all
# of them BF16 or none, and the word true on both sides is their shared stem.
MEGATRON_IN_PROJ_GROUPS = (
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # Qwen3.5
    ("in_proj_qkvz", "in_proj_ba"),  # Qwen3-Next
)
IN_PROJ_WORD = "linear_attn.in_proj"


@dataclass(frozen=True)
class HybridSpec:
    """Which layers are linear attention, and that attention's sizes."""

    layer_types: tuple[str, ...]
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    split_proj: bool
    """Qwen3.5's in_proj_qkv/z/b/a (True) or Qwen3-Next's in_proj_qkvz/ba (False)."""

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    def linears(self, prefix: str, layer: int, hidden: int) -> list[Linear]:
        """The linear-attention layer's projections, in execution order."""
        p = f"{prefix}.layers.{layer}.linear_attn"
        kd, vd = self.num_k_heads * self.k_head_dim, self.num_v_heads * self.v_head_dim
        nv, conv = self.num_v_heads, 2 * kd + vd

        def lin(kind: str, k_in: int, n_out: int) -> Linear:
            return Linear(f"{p}.{kind}", kind, layer, k_in, n_out, group="linear_attn")

        if self.split_proj:
            proj = [
                lin("in_proj_qkv", hidden, conv),
                lin("in_proj_z", hidden, vd),
                lin("in_proj_b", hidden, nv),
                lin("in_proj_a", hidden, nv),
            ]
        else:
            proj = [lin("in_proj_qkvz", hidden, 2 * kd + 2 * vd), lin("in_proj_ba", hidden, 2 * nv)]
        conv1d = Linear(
            f"{p}.conv1d",
            "conv1d",
            layer,
            1,
            conv,
            group="linear_attn",
            bf16_why=CONV_BF16,
            kernel=(self.conv_kernel,),
        )
        return [*proj, conv1d, lin("out_proj", vd, hidden)]


def read_hybrid(keys: Keys, num_layers: int, split_proj: bool) -> HybridSpec | None:
    """The hybrid part of a (text) config.json, or None when no layer is linear attention."""
    types = keys.config.get("layer_types")
    if types is None:
        if not keys.has("linear_num_value_heads"):
            return None
        every = keys.int("full_attention_interval", 4)
        types = [
            "linear_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)
        ]
    if not isinstance(types, list) or len(types) != num_layers:
        n = len(types) if isinstance(types, list) else type(types).__name__
        keys.problem(
            f"layer_types has {n} entries but num_hidden_layers={num_layers}: give one "
            f"of {list(LAYER_TYPES)} per layer"
        )
        return None
    unknown = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if unknown:
        keys.problem(
            f"layer_types has unknown {unknown}: each entry must be one of {list(LAYER_TYPES)}"
        )
        return None
    if "linear_attention" not in types:
        return None
    spec = HybridSpec(
        tuple(types),
        keys.int("linear_num_key_heads"),
        keys.int("linear_num_value_heads"),
        keys.int("linear_key_head_dim"),
        keys.int("linear_value_head_dim"),
        keys.int("linear_conv_kernel_dim", 4),
        split_proj,
    )
    if spec.num_v_heads % spec.num_k_heads:
        keys.problem(
            f"linear_num_value_heads={spec.num_v_heads} is not a multiple of "
            f"linear_num_key_heads={spec.num_k_heads}"
        )
    return spec


@dataclass(frozen=True)
class VisionSpec:
    """The vision tower's sizes (`vision_config` names)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    prefix: str = f"model.{VISION_WORD}"

    def linears(self) -> list[Linear]:
        """Every layer of the tower with weights, BF16 on both sides."""
        h, p = self.hidden_size, self.prefix
        merged = h * self.spatial_merge_size**2

        def lin(name: str, kind: str, k_in: int, n_out: int, **kw) -> Linear:
            return Linear(
                f"{p}.{name}", kind, None, k_in, n_out, True, "vision", bf16_why=VISION_BF16, **kw
            )

        patch = (self.temporal_patch_size, self.patch_size, self.patch_size)
        out = [
            lin("patch_embed.proj", "patch_embed", self.in_channels, h, kernel=patch),
            Linear(
                f"{p}.pos_embed",
                "pos_embed",
                None,
                self.num_position_embeddings,
                h,
                group="vision",
                bf16_why=VISION_BF16,
                embedding=True,
            ),
        ]
        for b in range(self.depth):
            out += [
                lin(f"blocks.{b}.attn.qkv", "qkv", h, 3 * h),
                lin(f"blocks.{b}.attn.proj", "proj", h, h),
                lin(f"blocks.{b}.mlp.linear_fc1", "linear_fc1", h, self.intermediate_size),
                lin(f"blocks.{b}.mlp.linear_fc2", "linear_fc2", self.intermediate_size, h),
            ]
        return [
            *out,
            lin("merger.linear_fc1", "linear_fc1", merged, merged),
            lin("merger.linear_fc2", "linear_fc2", merged, self.out_hidden_size),
        ]


def read_vision(keys: Keys, prefix: str) -> VisionSpec:
    """The vision tower of a multimodal config.json's ``vision_config`` (``keys``)."""
    return VisionSpec(
        depth=keys.int("depth"),
        hidden_size=keys.int("hidden_size"),
        intermediate_size=keys.int("intermediate_size"),
        out_hidden_size=keys.int("out_hidden_size"),
        in_channels=keys.int("in_channels", 3),
        patch_size=keys.int("patch_size", 16),
        temporal_patch_size=keys.int("temporal_patch_size", 2),
        spatial_merge_size=keys.int("spatial_merge_size", 2),
        num_position_embeddings=keys.int("num_position_embeddings", 2304),
        prefix=prefix,
    )
