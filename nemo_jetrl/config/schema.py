"""The config keys this package reads: NeMo-RL's own keys and our `jetrl:` section.

NeMo-RL users already describe precision with these keys (meanings as in NeMo-RL):

- ``policy.megatron_cfg.fp8_cfg.{enabled, fp8, fp8_recipe, fp8_param}``: Megatron/TE training FP8.
  ``fp8`` is TE's format knob ("e4m3" or "hybrid"), ``fp8_recipe`` the scaling ("blockwise" is the
  one that matches vLLM's block-quantized linears).
- ``policy.megatron_cfg.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES``: "1" makes TE's blockwise
  scales exact FP32 quotients; unset or "0" keeps TE's default power-of-two scales.
- ``policy.generation.vllm_cfg.precision`` ("fp8" quantizes vLLM's linears, 128x128 weight blocks
  and 1x128 activation groups), ``kv_cache_dtype`` ("auto" | "fp8" | "fp8_e4m3"),
  ``pow2_weight_scaling_factors`` / ``pow2_activation_scaling_factors`` (default false: FP32),
  ``num_first_layers_in_bf16`` / ``num_last_layers_in_bf16``, ``use_deep_gemm``.
- ``loss_fn.{use_importance_sampling_correction, truncated_importance_sampling_type,
  truncated_importance_sampling_ratio, truncated_importance_sampling_ratio_min,
  sequence_level_importance_ratios}``: importance-sampling correction (NeMo-RL's
  ClippedPGLossConfig rules apply).
- ``grpo.async_grpo.{enabled, max_trajectory_age_steps, in_flight_weight_updates}`` (the legacy
  async trainer) and, with ``grpo.async_grpo: null``, ``async_rl.sampler.{name,
  max_staleness_versions, max_lookahead_versions}`` (main's single-controller path): policy lag.

What NeMo-RL has no key for lives under ``jetrl:``; `nemo_jetrl.config.jetrl_model.JetrlSection`
documents every key there. Each key's type and values are checked by the typed schema
(`nemo_jetrl.config.typed`); this module holds the key paths and allowed values.
"""

from __future__ import annotations

from nemo_jetrl.recipe_parts import FP32_SCALES_ENV

# NeMo-RL key paths (dotted), one constant each so messages and align use the same spelling.
FP8_CFG = "policy.megatron_cfg.fp8_cfg"
FP8_ENABLED = f"{FP8_CFG}.enabled"
FP8_FORMAT = f"{FP8_CFG}.fp8"
FP8_RECIPE = f"{FP8_CFG}.fp8_recipe"
FP8_PARAM = f"{FP8_CFG}.fp8_param"
MEGATRON_ENABLED = "policy.megatron_cfg.enabled"
ENV_VARS = "policy.megatron_cfg.env_vars"
FP32_SCALES_KEY = f"{ENV_VARS}.{FP32_SCALES_ENV}"
GEN_BACKEND = "policy.generation.backend"
VLLM_CFG = "policy.generation.vllm_cfg"
VLLM_PRECISION = f"{VLLM_CFG}.precision"
VLLM_KV_DTYPE = f"{VLLM_CFG}.kv_cache_dtype"
VLLM_POW2_W = f"{VLLM_CFG}.pow2_weight_scaling_factors"
VLLM_POW2_A = f"{VLLM_CFG}.pow2_activation_scaling_factors"
VLLM_FIRST_BF16 = f"{VLLM_CFG}.num_first_layers_in_bf16"
VLLM_IGNORED_KWS = f"{VLLM_CFG}.quantization_ignored_layer_kws"
VLLM_LAST_BF16 = f"{VLLM_CFG}.num_last_layers_in_bf16"
VLLM_DEEP_GEMM = f"{VLLM_CFG}.use_deep_gemm"
VLLM_IS_MX = f"{VLLM_CFG}.is_mx"
VLLM_ASYNC = f"{VLLM_CFG}.async_engine"
PP_SIZE = "policy.megatron_cfg.pipeline_model_parallel_size"
MODEL_NAME = "policy.model_name"
LOSS_FN = "loss_fn"
IS_CORRECTION = "loss_fn.use_importance_sampling_correction"
TIS_TYPE = "loss_fn.truncated_importance_sampling_type"
TIS_RATIO = "loss_fn.truncated_importance_sampling_ratio"
TIS_RATIO_MIN = "loss_fn.truncated_importance_sampling_ratio_min"
SEQ_LEVEL_IS = "loss_fn.sequence_level_importance_ratios"
VLLM_TP = f"{VLLM_CFG}.tensor_parallel_size"
VLLM_EP = f"{VLLM_CFG}.expert_parallel_size"
LOCAL_MODEL_CONFIG = "jetrl.local.model_config"
# Mixture of experts: Megatron's expert keys (a value > 1 means experts), routing replay (R3)
# and Megatron's routing knobs `jetrl align` sets.
MEGATRON_TP = "policy.megatron_cfg.tensor_model_parallel_size"
MEGATRON_ETP = "policy.megatron_cfg.expert_tensor_parallel_size"
MEGATRON_MOE_KEYS = (
    "policy.megatron_cfg.expert_model_parallel_size",
    MEGATRON_ETP,
    "policy.megatron_cfg.num_moe_experts",
)
ROUTER_REPLAY = "policy.router_replay.enabled"
ROUTER_DTYPE = "policy.megatron_cfg.moe_router_dtype"
VPP_SIZE = "policy.megatron_cfg.virtual_pipeline_model_parallel_size"
MOE_CAPACITY = "policy.megatron_cfg.moe_expert_capacity_factor"
MOE_PAD_TO_CAPACITY = "policy.megatron_cfg.moe_pad_expert_input_to_capacity"
# Policy lag (async GRPO: legacy and single-controller) and ModelOpt quantization: what a
# precision verdict cannot model.
ASYNC_ENABLED = "grpo.async_grpo.enabled"
ASYNC_AGE = "grpo.async_grpo.max_trajectory_age_steps"
ASYNC_IN_FLIGHT = "grpo.async_grpo.in_flight_weight_updates"
# NeMo-RL main's single-controller async GRPO (examples/run_grpo_single_controller.py): it runs a
# config only with grpo.async_grpo null (run_grpo.py cannot run that one) and bounds how stale a
# trajectory may be by async_rl.sampler (nemo_rl/algorithms/async_utils/staleness_sampler.py).
ASYNC_GRPO = "grpo.async_grpo"
SAMPLER = "async_rl.sampler"
SAMPLER_NAME = f"{SAMPLER}.name"
SAMPLER_TARGET = f"{SAMPLER}.target"
SAMPLER_STALENESS = f"{SAMPLER}.max_staleness_versions"
SAMPLER_LOOKAHEAD = f"{SAMPLER}.max_lookahead_versions"
# The key that bounds each built-in sampler's staleness (a "custom" sampler's is its own).
SAMPLER_WINDOW_KEYS = {
    "windowed": SAMPLER_STALENESS,
    "ready_first": SAMPLER_STALENESS,
    "weight_fifo": SAMPLER_STALENESS,
    "in_order": SAMPLER_LOOKAHEAD,
}
SAMPLERS = (*SAMPLER_WINDOW_KEYS, "custom")
DATA_PLANE = "data_plane.enabled"
QUANT_CFG_KEYS = ("policy.quant_cfg", "policy.generation.quant_cfg")

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("blockwise", "mxfp8", "tensorwise", "delayed")
VLLM_PRECISIONS = ("bfloat16", "float16", "float32", "fp8")
# policy.precision: the training dtype; NeMo-RL's policy workers map these three to torch dtypes
# (models/megatron/setup.py, automodel/setup.py) and fail at setup on any other.
POLICY_PRECISIONS = ("bfloat16", "float16", "float32")
VLLM_KV_DTYPES = ("auto", "fp8", "fp8_e4m3")
ENV_FLAG_VALUES = ("0", "1")
KL_TYPES = ("k1", "k2", "k3")  # loss_fn.reference_policy_kl_type: Schulman's KL estimators
