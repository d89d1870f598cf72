"""The dense family's linears: grouped-query attention and the gated MLP.

Llama, Qwen2 and Qwen3 decoder layers (and the full-attention layers and dense MLPs of the MoE
and hybrid families) have these shapes, weights [out_features, in_features]:

    q_proj  [heads*head_dim (x2 with an output gate), hidden]
    k_proj, v_proj [kv_heads*head_dim, hidden]           o_proj [hidden, heads*head_dim]
    gate_proj, up_proj [intermediate, hidden]            down_proj [hidden, intermediate]

Nemotron-H's MLP is up/down only (squared ReLU, no gate). Qwen3-Next / Qwen3.5 attention has an
output gate: q_proj yields query and gate together, so
its output is twice heads*head_dim.
"""

from __future__ import annotations

from nemo_jetrl.arch.linear import Linear


def attention_linears(
    prefix: str,
    layer: int,
    hidden: int,
    q_width: int,
    kv_width: int,
    *,
    qkv_bias: bool = False,
    o_bias: bool = False,
    output_gate: bool = False,
    module: str = "self_attn",
) -> list[Linear]:
    """q/k/v/o of full attention in layer ``layer`` (``q_width`` = heads * head_dim), under
    ``module`` (Nemotron-H: "mixer")."""
    p = f"{prefix}.layers.{layer}.{module}"
    q_out = 2 * q_width if output_gate else q_width
    return [
        Linear(f"{p}.q_proj", "q_proj", layer, hidden, q_out, qkv_bias),
        Linear(f"{p}.k_proj", "k_proj", layer, hidden, kv_width, qkv_bias),
        Linear(f"{p}.v_proj", "v_proj", layer, hidden, kv_width, qkv_bias),
        Linear(f"{p}.o_proj", "o_proj", layer, q_width, hidden, o_bias),
    ]


def mlp_linears(
    module: str,
    layer: int,
    hidden: int,
    intermediate: int,
    group: str = "mlp",
    *,
    gated: bool = True,
    bias: bool = False,
) -> list[Linear]:
    """gate/up/down of a gated MLP at ``module`` (e.g. "model.layers.3.mlp"); up/down only
    when not ``gated`` (Nemotron-H's squared-ReLU MLP)."""
    gate = [Linear(f"{module}.gate_proj", "gate_proj", layer, hidden, intermediate, bias, group)]
    return [
        *(gate if gated else []),
        Linear(f"{module}.up_proj", "up_proj", layer, hidden, intermediate, bias, group),
        Linear(f"{module}.down_proj", "down_proj", layer, intermediate, hidden, bias, group),
    ]
