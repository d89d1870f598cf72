"""The mixture-of-experts family: routed experts, the router, shared experts, dense layers.

An MoE layer's MLP (`mlp.`) holds, as transformers 5 stores them (weights [E, out, in]):

    experts.gate_up_proj [E, 2*I, hidden]   experts.down_proj [E, hidden, I]   (I: one expert)
    experts.up_proj [E, I, hidden], no gate  (Nemotron-H: `mamba`, with optional latent projections)
    gate (the router) [E, hidden]           BF16/FP32 on both sides, never FP8
    shared_expert.{gate,up,down}_proj + shared_expert_gate [1, hidden]   (Qwen2-MoE, Qwen3-Next)
    shared_experts.{gate,up,down}_proj, width n_shared_experts * I       (DeepSeek-V3)

Checkpoints on the hub and vLLM's loader name each expert's own matrices
(`experts.{e}.gate_proj` ...; Mixtral, MiniMax-M2: `block_sparse_moe.experts.{e}.w1/w3/w2`);
`per_expert_linears` lists them. The other layers have a dense MLP (`mlp.{gate,up,down}_proj`,
width `intermediate_size`). Which layers are MoE, read with the keys each model type names:

    qwen2_moe, qwen3_moe, qwen3_next   layer i not in mlp_only_layers and (i+1) % decoder_sparse_step == 0
    qwen3_5_moe, mixtral, minimax_m2   every layer
    deepseek_v3 (DeepSeek-V3, Moonlight)   i >= first_k_dense_replace and i % moe_layer_freq == 0

Expert counts: `num_experts` (Qwen), `num_local_experts` (Mixtral), `n_routed_experts`
(DeepSeek); top-k `num_experts_per_tok`; expert width `moe_intermediate_size` (Mixtral, MiniMax-M2:
`intermediate_size`).
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_jetrl.arch.dense import mlp_linears
from nemo_jetrl.arch.keys import Keys
from nemo_jetrl.arch.linear import ROUTER_BF16, Linear

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""config.json keys that count routed experts (Qwen, Mixtral, DeepSeek spellings)."""

_COUNT_KEY_OF = {"deepseek": "n_routed_experts", "mixtral": "num_local_experts"}
# Every layer MoE, no dense MLP: `intermediate_size` is one expert's width (MiniMax-M2 is
# Mixtral's block with a sigmoid router; transformers 5.24 minimax_m2).
_NO_DENSE_MLP = ("mixtral", "minimax_m2")
# vLLM 0.20 / 0.25.1 / 0.32 build `shared_expert_gate` as a ReplicatedLinear with
# quant_config=None (qwen2_moe.py, qwen3_next.py; qwen3_5.py reuses qwen3_next's block);
# megatron-core 0.16's SharedExpertMLP holds it as a plain `gate_weight` Parameter in
# params_dtype, applied with torch's F.linear outside TE's FP8 autocast. A [1, hidden] weight
# cannot be 128x128-blocked either.
SHARED_GATE_BF16 = (
    "the [1, hidden] shared-expert gate (sigmoid): BF16 on both sides (vLLM builds it without "
    "quant_config; Megatron applies gate_weight with torch, outside TE)"
)


LATENT = "moe_latent"
"""The group of Nemotron 3 Super's dense projections into and out of the experts' latent space."""


@dataclass(frozen=True)
class MoeSpec:
    """The MoE part of a model description."""

    num_experts: int
    """Routed experts per MoE layer."""

    top_k: int
    """Experts each token is routed to (`num_experts_per_tok`)."""

    expert_size: int
    """One expert's MLP width I."""

    moe_layers: frozenset[int]
    """Decoder layers whose MLP is the MoE block (the others are dense)."""

    shared_size: int = 0
    """Shared experts' MLP width (0: none)."""

    shared_module: str = "shared_expert"
    """"shared_expert" (Qwen, with `shared_expert_gate`) or "shared_experts" (DeepSeek)."""

    routing: str = ""
    """What vLLM's router does for this family beyond softmax top-k (empty: just that):
    DeepSeek's grouped top-k with a scaling factor (V3: sigmoid scores and a correction bias),
    MiniMax-M2's sigmoid scores with a bias."""

    gated: bool = True
    """Experts are gate_up/down (SwiGLU); False: up/down only (Nemotron-H, squared ReLU), as
    are its shared experts."""

    latent_size: int = 0
    """Tokens enter the experts projected to this width (`fc1_latent_proj`, and back with
    `fc2_latent_proj`: Nemotron 3 Super); 0: the experts read the hidden state."""

    bias: bool = False
    """Shared experts and latent projections have biases (Nemotron-H's `mlp_bias`)."""

    def block_linears(self, module: str, layer: int, hidden: int) -> list[Linear]:
        """The MoE block at ``module`` (e.g. "model.layers.3.mlp"), in execution order."""
        e, i, width = self.num_experts, self.expert_size, self.latent_size or hidden
        up, up_out = ("gate_up_proj", 2 * i) if self.gated else ("up_proj", i)

        def latent(kind: str, k_in: int, n_out: int) -> list[Linear]:
            name = f"{kind}_latent_proj"  # dense, around the experts (Nemotron 3 Super)
            lin = Linear(f"{module}.{name}", name, layer, k_in, n_out, self.bias, LATENT)
            return [lin] if self.latent_size else []

        out = [
            Linear(
                f"{module}.gate", "gate", layer, hidden, e, group="router", bf16_why=ROUTER_BF16
            ),
            *latent("fc1", hidden, width),
            Linear(f"{module}.experts.{up}", up, layer, width, up_out, group="experts", experts=e),
            Linear(
                f"{module}.experts.down_proj",
                "down_proj",
                layer,
                i,
                width,
                group="experts",
                experts=e,
            ),
            *latent("fc2", width, hidden),
        ]
        if self.shared_size:
            shared = f"{module}.{self.shared_module}"
            out += mlp_linears(
                shared,
                layer,
                hidden,
                self.shared_size,
                group="shared_experts",
                gated=self.gated,
                bias=self.bias,
            )
            if self.shared_module == "shared_expert":
                out.append(
                    Linear(
                        f"{module}.shared_expert_gate",
                        "shared_expert_gate",
                        layer,
                        hidden,
                        1,
                        group="shared_experts",
                        bf16_why=SHARED_GATE_BF16,
                    )
                )
        return out


def per_expert_linears(fused: Linear, mixtral: bool = False) -> list[Linear]:
    """One fused expert tensor as the per-expert linears of a hub checkpoint / vLLM's loader:
    gate_up_proj -> experts.{e}.gate_proj and .up_proj; down_proj -> experts.{e}.down_proj
    (Mixtral: block_sparse_moe.experts.{e}.w1 / w3 / w2)."""
    base = fused.name.rsplit(".", 1)[0]  # "...mlp.experts"
    if mixtral:
        base = base.replace(".mlp.experts", ".block_sparse_moe.experts")
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    if fused.kind == "gate_up_proj":
        n = fused.out_features // 2
        parts = [("gate_proj", fused.in_features, n), ("up_proj", fused.in_features, n)]
    elif fused.kind == "up_proj":  # non-gated experts (Nemotron-H)
        parts = [("up_proj", fused.in_features, fused.out_features)]
    else:
        parts = [("down_proj", fused.in_features, fused.out_features)]
    return [
        Linear(
            f"{base}.{e}.{names[k] if mixtral else k}", k, fused.layer, kin, kout, group="experts"
        )
        for e in range(fused.experts)
        for k, kin, kout in parts
    ]


def read_moe(keys: Keys, model_type: str, num_layers: int) -> MoeSpec | None:
    """The MoE part of a config.json, or None for a dense model; problems go to ``keys``."""
    present = [k for k in EXPERT_COUNT_KEYS if keys.config.get(k) is not None]
    if not present:
        return None
    # The model type's own spelling first (a DeepSeek config may carry a stray num_experts).
    own = _COUNT_KEY_OF.get(model_type.split("_")[0], "num_experts")
    count_key = own if own in present else present[0]
    num = keys.int(count_key, minimum=0)
    if num == 0:
        keys.problem(
            f"{count_key}=0: a mixture-of-experts model needs at least one expert (remove "
            f"{count_key} for a dense model)"
        )
        num = 1
    top_k = keys.int("num_experts_per_tok")
    if top_k > num:
        keys.problem(
            f"num_experts_per_tok={top_k} exceeds {count_key}={num}: a token cannot be routed "
            f"to more experts than there are; set num_experts_per_tok <= {num}"
        )
    size_key = "intermediate_size" if model_type in _NO_DENSE_MLP else "moe_intermediate_size"
    size = keys.int(size_key)
    shared, shared_module = 0, "shared_expert"
    routing = "sigmoid scores with a bias (MiniMax-M2)" if model_type == "minimax_m2" else ""
    if model_type.startswith("deepseek"):
        first = keys.int("first_k_dense_replace", 0, minimum=0)
        freq = keys.int("moe_layer_freq", 1)
        if first > num_layers:
            keys.problem(f"first_k_dense_replace={first} exceeds num_hidden_layers={num_layers}")
        layers = frozenset(i for i in range(num_layers) if i >= first and i % freq == 0)
        shared = keys.int("n_shared_experts", 0, minimum=0) * size
        shared_module, routing = "shared_experts", "grouped top-k (DeepSeek)"
        n_group, topk_group = keys.int("n_group", 1), keys.int("topk_group", 1)
        if num % n_group:
            keys.problem(f"n_routed_experts={num} is not a multiple of n_group={n_group}")
        if topk_group > n_group:
            keys.problem(f"topk_group={topk_group} exceeds n_group={n_group}")
    elif model_type in _NO_DENSE_MLP or model_type.startswith("qwen3_5_moe"):
        layers = frozenset(range(num_layers))  # no dense layers in these families
        if model_type not in _NO_DENSE_MLP:
            shared = keys.int("shared_expert_intermediate_size", 0, minimum=0)
    else:
        dense = set(keys.int_list("mlp_only_layers", num_layers))
        step = keys.int("decoder_sparse_step", 1)
        layers = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        if model_type != "qwen3_moe":  # transformers' Qwen3-MoE builds none, whatever the key
            shared = keys.int("shared_expert_intermediate_size", 0, minimum=0)
    return MoeSpec(num, top_k, size, layers, shared, shared_module, routing)
