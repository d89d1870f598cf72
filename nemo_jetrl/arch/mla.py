"""Multi-head latent attention (DeepSeek-V2/V3, Moonlight): the attention linears of
`model_type` deepseek_v3, weights [out, in]:

    q_a_proj [q_lora_rank, hidden]   q_b_proj [heads*(qk_nope_head_dim+qk_rope_head_dim), q_lora_rank]
      (q_lora_rank null, as in Moonlight: one q_proj [heads*(nope+rope), hidden])
    kv_a_proj_with_mqa [kv_lora_rank + qk_rope_head_dim, hidden]
    kv_b_proj [heads*(qk_nope_head_dim+v_head_dim), kv_lora_rank]
    o_proj [hidden, heads*v_head_dim]

`attention_bias` adds biases to q_a_proj, kv_a_proj_with_mqa and o_proj (transformers 5).
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_jetrl.arch.keys import Keys
from nemo_jetrl.arch.linear import Linear

KV_B_WORD = "kv_b_proj"
"""The per-name BF16 word that keeps kv_b_proj BF16 on both sides (vLLM's ignored layers, our
patch's BF16 list; Megatron's ``linear_kv_up_proj``, `megatron.bf16_names`)."""
KV_B_ABSORBED = (
    "vLLM's MLA decode never runs kv_b_proj as a GEMM: MLAAttention.process_weights_after_loading "
    "dequantizes its FP8 weight once into BF16 W_UK_T/W_UV (the absorbed path) and decode "
    "multiplies the BF16 query and attention output by them, so its input (the latent kv_c) is "
    "never quantized to FP8 1x128 there, while training's FP8 kv_b_proj GEMM quantizes it"
)
"""Why a vLLM rollout runs kv_b_proj's product in BF16 (vLLM 0.32 mla_attention.py
``forward_mqa``; its GPU MLA backends use the same W_UK_T/W_UV). Prefill runs kv_b_proj on the
FP8 kernel, but one path off training's numbers is enough to be off-policy."""


@dataclass(frozen=True)
class MlaSpec:
    """The latent-attention sizes (config.json names)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    bias: bool = False

    def linears(self, prefix: str, layer: int, hidden: int, heads: int) -> list[Linear]:
        p = f"{prefix}.layers.{layer}.self_attn"
        qk = heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        b = self.bias
        if self.q_lora_rank is None:
            out = [Linear(f"{p}.q_proj", "q_proj", layer, hidden, qk)]
        else:
            r = self.q_lora_rank
            out = [
                Linear(f"{p}.q_a_proj", "q_a_proj", layer, hidden, r, b, group="attn"),
                Linear(f"{p}.q_b_proj", "q_b_proj", layer, r, qk, group="attn"),
            ]
        kv = self.kv_lora_rank
        return [
            *out,
            Linear(
                f"{p}.kv_a_proj_with_mqa",
                "kv_a_proj_with_mqa",
                layer,
                hidden,
                kv + self.qk_rope_head_dim,
                b,
                group="attn",
            ),
            Linear(
                f"{p}.kv_b_proj",
                "kv_b_proj",
                layer,
                kv,
                heads * (self.qk_nope_head_dim + self.v_head_dim),
                group="attn",
                vllm_bf16_why=KV_B_ABSORBED,
            ),
            Linear(f"{p}.o_proj", "o_proj", layer, heads * self.v_head_dim, hidden, b),
        ]


def read_mla(keys: Keys) -> MlaSpec:
    """The MLA sizes of a deepseek_v3 config.json; problems go to ``keys``."""
    q_lora = keys.config.get("q_lora_rank")
    return MlaSpec(
        q_lora_rank=None if q_lora is None else keys.int("q_lora_rank"),
        kv_lora_rank=keys.int("kv_lora_rank"),
        qk_nope_head_dim=keys.int("qk_nope_head_dim"),
        qk_rope_head_dim=keys.int("qk_rope_head_dim"),
        v_head_dim=keys.int("v_head_dim"),
        bias=bool(keys.config.get("attention_bias", False)),
    )
