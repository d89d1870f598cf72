"""What `jetrl align` writes for a mixture-of-experts model (issue 28), beyond the recipe's keys.

Exact FP8 experts are not enough for an on-policy MoE step: a BF16 router computed by two
different GEMMs can pick other experts for a token. NeMo-RL (v0.7.0 and main) has routing replay
(R3): ``policy.router_replay.enabled`` makes vLLM return each token's experts
(``configure_vllm_for_router_replay``: ``vllm_kwargs.enable_return_routed_experts``, set by
``grpo.setup``) and the Megatron worker route with them. ``validate_router_replay_config``
(``nemo_rl/models/megatron/router_replay.py``) requires vLLM generation, the Megatron policy and
no virtual pipeline parallelism; async GRPO with replay also needs ``data_plane.enabled=false``
(``async_grpo_train``). Without the Megatron policy there is no replay: said, not written.

The Megatron side routes every token (vLLM never drops one): NeMo-RL passes no capacity keys to
Megatron (``_apply_moe_config``), so its routing is dropless unless a config sets
``moe_expert_capacity_factor`` / ``moe_pad_expert_input_to_capacity`` for our mapping
(``nemo_jetrl.megatron.moe``); align clears them. The router's softmax/top-k run in
``moe_router_dtype``: fp32 unless the config already asks for fp32 or fp64.
"""

from __future__ import annotations

from typing import Any

from nemo_jetrl.config import Settings
from nemo_jetrl.config import schema as S
from nemo_jetrl.flow.support import moe_evidence

ROUTER_REPLAY = S.ROUTER_REPLAY
ROUTER_DTYPE = S.ROUTER_DTYPE
ROUTER_DTYPES = ("fp32", "fp64")
VPP = S.VPP_SIZE
CAPACITY = S.MOE_CAPACITY
PAD_TO_CAPACITY = S.MOE_PAD_TO_CAPACITY
DATA_PLANE = S.DATA_PLANE


def moe_align_updates(settings: Settings) -> tuple[dict[str, Any], list[str]]:
    """(flat dotted keys to write, notes to print) for an MoE config; ({}, []) for a dense one."""
    if not moe_evidence(settings):
        return {}, []
    out: dict[str, Any] = {}
    notes: list[str] = []
    moe = settings.moe
    megatron = settings.megatron_enabled is True
    if megatron and settings.generation_backend == "vllm":
        if moe.router_replay is not True:
            out[ROUTER_REPLAY] = True
        if moe.virtual_pipeline not in (None, 1):
            out[VPP] = None  # NeMo-RL's router replay refuses virtual pipeline parallelism
        if settings.lag.async_enabled and settings.lag.data_plane:
            out[DATA_PLANE] = False
    else:
        notes.append(
            f"routing is not replayed: NeMo-RL's {ROUTER_REPLAY} needs the Megatron policy "
            f"({S.MEGATRON_ENABLED}: true) and vLLM generation; the rollout's and the "
            "trainer's routers may pick different experts for a token"
        )
    if megatron:
        if moe.router_dtype not in ROUTER_DTYPES:
            out[ROUTER_DTYPE] = "fp32"
        if moe.capacity_factor is not None:
            out[CAPACITY] = None  # dropless: every routed token reaches its experts
        if moe.pad_to_capacity is True:
            out[PAD_TO_CAPACITY] = False
    return out, notes


def load_source(path: str, overrides: list[str]) -> Any:
    """The config align starts from, validated (UserError listing every problem), without the
    check's refusal of what no backend runs on-policy yet: align writes the file, and the check
    of what it wrote says whether it runs."""
    from nemo_jetrl.config import ConfigError, load_valid_config
    from nemo_jetrl.errors import UserError
    from nemo_jetrl.flow.pipeline import BACKEND_SECTIONS

    try:
        return load_valid_config(path, overrides, sections=BACKEND_SECTIONS)
    except ConfigError as exc:
        raise UserError(f"invalid config\n{exc}") from None


# HF model types whose vLLM MoE block builds the router (`mlp.gate`) with the model's
# quant_config, so an FP8 engine holds it in FP8 unless a per-name word keeps it BF16 (vLLM 0.20
# qwen3_moe.py; qwen2_moe, qwen3_next, mixtral and deepseek_v2 build it unquantized).
QUANTIZED_ROUTER_TYPES = ("qwen3_moe",)
ROUTER_WORD = "mlp.gate"


def router_bf16_words(
    arch: Any, recipe: Any, kws: tuple[str, ...]
) -> tuple[tuple[str, ...], list[str]]:
    """(per-name BF16 words to add to ``kws`` on both sides, notes): ``mlp.gate`` for a model
    whose vLLM router would otherwise be FP8 in ``recipe``'s FP8 rollout (NeMo-RL's
    ``init_fp8`` does not list it)."""
    moe = getattr(arch, "moe", None)
    if moe is None or not recipe.rollout.fp8_linears:
        return (), []
    if getattr(arch, "model_type", None) not in QUANTIZED_ROUTER_TYPES:
        return (), []
    if any(ROUTER_WORD in kw for kw in kws):
        return (), []
    if len(moe.moe_layers) != arch.num_layers:  # the word would also match dense gate_proj
        return (), [
            f"{arch.name}'s vLLM router ({ROUTER_WORD}) is FP8 in an FP8 rollout; with dense MLP "
            f"layers {ROUTER_WORD!r} would also match their gate_proj: list each router "
            "(model.layers.N.mlp.gate) in quantization_ignored_layer_kws and "
            "jetrl.train_bf16_layer_kws"
        ]
    return (ROUTER_WORD,), []
