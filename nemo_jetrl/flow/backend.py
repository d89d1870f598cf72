"""Per backend, whether the on-policy verdict holds there: the one home of that rule.

`check_on_policy` compares the rollout the recipe describes with the training forward. Where the
rollout actually runs can add a difference the recipe does not show:

- local (embedded CPU backend): the recipe is what runs; the flow verdict holds, for the models
  it runs: a family it does not run (`backends.local.families`: the MoE families MiniMax-M2,
  DeepSeek-V3, Qwen3.5-MoE and shared experts, and Nemotron-H's Mamba-2 layers) gets "not run"
  (no verdict; `jetrl train --backend local` refuses).
- NeMo-RL (v0.7.0 and main): at every refit NeMo-RL streams BF16 weights to its vLLM worker,
  which quantizes them with its own code (``cast_tensor_to_fp8_blockwise``, ``x / (amax/448)``),
  unless our refit hook (``jetrl.refit_hook``, default on with ``jetrl.vllm_patch``) quantizes
  them with nemo_jetrl.fp8. Measured against TE's quantizer on 4x2048^2 BF16 weights: 0 differing
  bytes with power-of-two scales, 402 per million with FP32 scales. Without the hook NeMo-RL
  v0.7.0's colocated refit also sends vLLM no calibrated KV scales (grpo.py ~1924).
- NeMo-RL with ``policy.megatron_cfg.enabled: false`` (its DTensor/automodel policy, as the
  MiniMax-M2.7 config): ``fp8_cfg`` is read by the Megatron policy worker only, so training is
  BF16 whatever the recipe says; an FP8-training recipe is off there.
- NeMo-RL with FP8 routed experts: the rollout's experts run nemo_jetrl's vLLM experts kernel only
  on the vLLM releases it covers (`vllm_patch.moe_versions.moe_supported`: 0.20.0, 0.25.1,
  0.32.x). Both trees' releases are covered (v0.7.0 ships vLLM 0.20.0, main 0.25.1); on another
  release the patch's guard refuses vLLM's own FP8 expert kernels at engine start, so such a run
  stops instead of rolling out off-policy, and the verdict names it off.
- NeMo-RL's Megatron training where TE's blocks are not the rollout's (`flow.megatron_layout`:
  a fused ``linear_qkv`` with a head dim off 128, a tensor-parallel shard cutting 128-blocks),
  or vLLM's tensor parallelism cutting the rollout's blocks (`flow.vllm_layout`): the weights
  trained are not the weights sampled, whatever the refit does. Not judged for the local
  backend's own model, which NeMo-RL cannot load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_jetrl.config import Settings
from nemo_jetrl.config.schema import FP8_ENABLED, MEGATRON_ENABLED
from nemo_jetrl.flow.check import FlowCheck
from nemo_jetrl.flow.megatron_layout import megatron_block_problem
from nemo_jetrl.flow.vllm_layout import vllm_block_problem

NEMO_RL_TREES = ("v0.7.0", "main")
# The vLLM release each NeMo-RL tree pins (its pyproject.toml).
NEMO_RL_VLLM = {"v0.7.0": "0.20.0", "main": "0.25.1"}


KV_ATTENTION_CAVEAT = (
    "; the FP8 KV cache is on-policy on vLLM's CPU attention only (jetrl rehearse): on CUDA no "
    "vLLM attention serves it and the launch refuses it (before Ray, or at engine start when "
    "the launch builds vLLM's venv), so on a GPU cluster "
    "use recipe jetrl (BF16 KV cache; docs/kvcache.md)"
)


@dataclass(frozen=True)
class BackendVerdict:
    """The verdict on one backend."""

    backend: str
    """Backend name: "local", "nemo-rl v0.7.0" or "nemo-rl main"."""

    on_policy: bool
    """True when every rollout tensor equals its training-forward tensor there."""

    reason: str
    """Why, in plain words."""

    runs: bool = True
    """False when this backend does not run the model at all (no verdict claimed there)."""


def nemo_rl_refit(
    settings: Settings, check: FlowCheck, tree: str, routing: str = "", arch: Any = None
) -> BackendVerdict:
    """The verdict on NeMo-RL ``tree`` given how its refit quantizes weights and KV scales
    (``routing``: the model's `MoeSpec.routing`) and how Megatron lays out the weights TE
    quantizes (``arch``: the model checked; `flow.megatron_layout`)."""
    name = f"nemo-rl {tree}"
    recipe = check.recipe
    if not check.on_policy:
        return BackendVerdict(name, False, "off-policy as the flow check says")
    if recipe.train.fp8_linears and settings.megatron_off:
        return BackendVerdict(
            name,
            False,
            f"training FP8 ({FP8_ENABLED}) is applied by NeMo-RL's Megatron policy only; with "
            f"{MEGATRON_ENABLED}=false the DTensor (automodel) policy trains in BF16 while the "
            "recipe says FP8 (and our refit hook and policy worker are Megatron's). Set "
            f"{MEGATRON_ENABLED}=true and policy.dtensor_cfg.enabled=false where NeMo-RL's "
            f"Megatron path runs this model, or {FP8_ENABLED}=false with a BF16 rollout",
        )
    if not recipe.rollout.fp8_linears:
        return BackendVerdict(name, True, "BF16 rollout: refit copies the weights unchanged")
    # the model's FP8 blocks on each side, as Megatron and vLLM lay the weights out; not for the
    # local backend's own model, which NeMo-RL cannot load (a verdict on the recipe there)
    shape = None if _local_model(settings) else arch
    blocks = megatron_block_problem(shape, settings, recipe) or vllm_block_problem(
        shape, settings, recipe
    )
    if blocks is not None:
        return BackendVerdict(name, False, blocks)
    fp8_experts = any(e.group == "experts" and e.precision.is_fp8 for e in check.rollout.edges)
    if fp8_experts:
        from nemo_jetrl.vllm_patch.moe_versions import COVERED, moe_supported, own_routing

        vllm = NEMO_RL_VLLM[tree]
        if not moe_supported(vllm):
            return BackendVerdict(
                name,
                False,
                f"FP8 routed experts on NeMo-RL {tree}'s vLLM {vllm}: nemo_jetrl's experts "
                f"kernel covers vLLM {COVERED} only, so on this release the patch's guard "
                "refuses vLLM's own FP8 expert kernels at engine start: not runnable on-policy "
                "here yet",
            )
        if routing and own_routing(vllm):
            return BackendVerdict(
                name,
                False,
                f"FP8 routed experts with {routing} routing on NeMo-RL {tree}'s vLLM {vllm}: "
                "before vLLM 0.32 nemo_jetrl's experts kernel routes the tokens itself, softmax "
                "top-k only, and refuses these layers when vLLM builds them: not runnable "
                "on-policy here yet",
            )
    refit = settings.refit
    if refit.ours:
        parity, rollback = refit.parity_check, refit.rollback
        return BackendVerdict(
            name,
            True,
            "refit weights quantized by nemo_jetrl.fp8 (our refit hook)"
            + (", parity checked at each refit" if parity else "")
            + (", a failed refit rolled back" if rollback else "")
            + (KV_ATTENTION_CAVEAT if recipe.kv_fp8 else ""),
        )
    if not recipe.rollout.pow2_weight_scales:
        return BackendVerdict(
            name,
            False,
            f"FP32 scales on NeMo-RL {tree} without our refit hook: weights differ (NeMo-RL's "
            "vLLM worker requantizes the BF16 weights with x / (amax/448); 402 bytes per million "
            "differ from TE's). Set jetrl.vllm_patch=true and jetrl.refit_hook=true",
        )
    if recipe.kv_fp8 and tree == "v0.7.0":
        return BackendVerdict(
            name,
            False,
            "FP8 KV cache on NeMo-RL v0.7.0 without our refit hook: its colocated refit sends "
            "vLLM no calibrated KV scales (vLLM uses 1.0). Set jetrl.refit_hook=true",
        )
    return BackendVerdict(
        name,
        True,
        "power-of-two weight scales: NeMo-RL's own refit cast gives TE's bytes (measured: 0 differ)",
    )


def _local_model(settings: Settings) -> bool:
    """The config's model is the local backend's own (built from ``jetrl.local.model_config``,
    never on the hub)."""
    from nemo_jetrl.config.jetrl_model import LOCAL_MODEL_NAME

    return bool(settings.model.local_config) or settings.model.name == LOCAL_MODEL_NAME


def backend_verdicts(
    settings: Settings, check: FlowCheck, arch: Any = None
) -> tuple[BackendVerdict, ...]:
    """The verdict on every backend: local, then each NeMo-RL tree (``arch``: the model
    checked, for what the local backend runs)."""
    from nemo_jetrl.backends.local.families import local_family_problem

    problem = local_family_problem(arch)
    if problem is not None:
        where = settings.model.chosen_by
        local = BackendVerdict("local", False, f"{problem} ({where}); no local verdict", runs=False)
    else:
        local = BackendVerdict(
            "local", check.on_policy, "the recipe runs as written (embedded CPU backend)"
        )
        if not check.on_policy and arch is not None and settings.local.rollout_engine == "hf":
            local = _local_hf_rollout(check, arch) or local
    routing = arch.moe.routing if arch is not None and arch.moe is not None else ""
    return (local, *(nemo_rl_refit(settings, check, t, routing, arch) for t in NEMO_RL_TREES))


def _local_hf_rollout(check: FlowCheck, arch: Any) -> BackendVerdict | None:
    """The local verdict where only vLLM's own BF16 products (`flow.vllm_bf16`) are off: the
    local HF rollout (``jetrl.local.rollout_engine: hf``) runs them as FP8 GEMMs; else None."""
    from nemo_jetrl.flow.check import check_on_policy
    from nemo_jetrl.flow.graph import HF_ROLLOUT_BUILDERS

    if not check_on_policy(arch, check.recipe, HF_ROLLOUT_BUILDERS).on_policy:
        return None
    return BackendVerdict(
        "local",
        True,
        "the recipe runs as written (embedded CPU backend): its HF rollout runs every FP8 linear "
        "as the recipe's FP8 GEMM (kv_b_proj included), unlike vLLM's MLA decode",
    )
