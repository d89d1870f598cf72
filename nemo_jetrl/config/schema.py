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

What NeMo-RL has no key for lives under ``jetrl:``; `JETRL_KEYS` documents every key there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from nemo_jetrl.recipe import PRESET_NAMES
from nemo_jetrl.recipe_parts import (
    KV_DATA_FRACTION,
    KV_MARGIN,
    KV_MASK,
    KV_MASKS,
    KV_PERCENTILE,
    KV_REDUCTIONS,
    KV_SCALE_SOURCES,
)

# NeMo-RL key paths (dotted), one constant each so messages and align use the same spelling.
FP8_CFG = "policy.megatron_cfg.fp8_cfg"
FP8_ENABLED = f"{FP8_CFG}.enabled"
FP8_FORMAT = f"{FP8_CFG}.fp8"
FP8_RECIPE = f"{FP8_CFG}.fp8_recipe"
FP8_PARAM = f"{FP8_CFG}.fp8_param"
MEGATRON_ENABLED = "policy.megatron_cfg.enabled"
ENV_VARS = "policy.megatron_cfg.env_vars"
FP32_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
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

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("blockwise", "mxfp8", "tensorwise", "delayed")
VLLM_PRECISIONS = ("bfloat16", "float16", "float32", "fp8")
VLLM_KV_DTYPES = ("auto", "fp8", "fp8_e4m3")
ENV_FLAG_VALUES = ("0", "1")


@dataclass(frozen=True)
class KeySpec:
    """One key of the `jetrl:` section."""

    types: tuple[Any, ...]
    """Python types accepted (None in the tuple means null is allowed)."""

    default: Any
    """Default when the key is absent."""

    doc: str
    """Plain-words meaning, shown in docs and error messages."""

    choices: tuple[Any, ...] = ()
    """Allowed values for enumerations (empty: any value of the types)."""


_NULL = type(None)

KV_CALIBRATION_KEYS: Mapping[str, KeySpec] = MappingProxyType(
    {
        "enabled": KeySpec((bool,), True, "recalibrate Q/K/V scales on the trainer every step"),
        "data_fraction": KeySpec(
            (int, float),
            KV_DATA_FRACTION,
            "fraction (0, 1] of the step's sequences the observers see",
        ),
        "percentile": KeySpec(
            (int, float), KV_PERCENTILE, "percentile (0, 100] of per-micro-batch amax; 100 = max"
        ),
        "margin": KeySpec((int, float), KV_MARGIN, "factor >= 1 applied to amax before the scale"),
        "mask": KeySpec(
            (str,),
            KV_MASK,
            "tokens observed: response only, all real tokens, or none masked (with padding)",
            KV_MASKS,
        ),
        "reduction": KeySpec(
            (str, _NULL),
            None,
            "how per-micro-batch amax samples combine: max, or the percentile above; "
            "null = max when percentile is 100, else percentile",
            (*KV_REDUCTIONS, None),
        ),
        "include_q": KeySpec(
            (bool, _NULL),
            None,
            "also calibrate q_scale (attention kernels taking FP8 queries); null = the backend "
            "decides (local: true; NeMo-RL: when NeMo-RL asks)",
        ),
        "micro_batch_size": KeySpec(
            (int, _NULL),
            None,
            "sequences per calibration forward pass (> 0, one amax sample each); null = the "
            "backend's default (local: 32; NeMo-RL: its calibration batch, else "
            "policy.logprob_batch_size)",
        ),
    }
)

JETRL_KEYS: Mapping[str, KeySpec] = MappingProxyType(
    {
        "recipe": KeySpec(
            (str, _NULL),
            None,
            "the recipe this config is meant to be (a label); the NeMo-RL keys decide, and "
            "`jetrl check` warns when they describe something else",
            (*PRESET_NAMES, None),
        ),
        "vllm_patch": KeySpec(
            (bool,),
            False,
            "apply nemo_jetrl's vLLM patch: vLLM quantizes activations with TE's formula and "
            "loads trainer-quantized weights without requantizing",
        ),
        "onpolicy_kv": KeySpec(
            (bool,),
            False,
            "the trainer's attention applies the rollout's FP8 KV quantization (same scales)",
        ),
        "kv_scale_source": KeySpec(
            (str, _NULL),
            None,
            "where FP8 KV scales come from; null = trainer_calibrated when kv_calibration."
            "enabled, else dynamic",
            (*(s for s in KV_SCALE_SOURCES if s != "none"), None),
        ),
        "kv_calibration": KeySpec(
            (Mapping, _NULL), None, "trainer-side Q/K/V scale calibration (see below)"
        ),
        "refit_hook": KeySpec(
            (bool,),
            True,
            "NeMo-RL backend: refit weights are quantized by nemo_jetrl.fp8 inside NeMo-RL's "
            "vLLM worker (our hook) instead of NeMo-RL's own cast; false leaves NeMo-RL's, whose "
            "bytes differ from TE's with FP32 scales",
        ),
        "refit_parity_check": KeySpec(
            (bool,),
            True,
            "after each refit, compare the rollout engine's FP8 weights with the trainer's",
        ),
        "refit_rollback": KeySpec(
            (bool,),
            True,
            "snapshot the rollout engine's model before each refit and restore it (checked bit "
            "for bit) if the refit fails once tensors reached it; costs one copy of the model's "
            "tensors during the refit (on the GPU when it fits, else host memory)",
        ),
        "allow_off_policy": KeySpec(
            (bool,), False, "let `jetrl train` run a recipe that `jetrl check` finds off-policy"
        ),
        "train_num_first_layers_in_bf16": KeySpec(
            (int,),
            0,
            "leading decoder layers kept BF16 in training (Megatron's num_layers_at_start_in_bf16)",
        ),
        "train_bf16_layer_kws": KeySpec(
            (list, _NULL),
            None,
            "decoder linears kept BF16 in training: those whose HF name contains one of these "
            "words (the training twin of vllm_cfg.quantization_ignored_layer_kws)",
        ),
        "train_num_last_layers_in_bf16": KeySpec(
            (int,),
            0,
            "trailing decoder layers kept BF16 in training (Megatron's num_layers_at_end_in_bf16)",
        ),
        "unaligned_layers": KeySpec(
            (str,),
            "error",
            "linears whose dims are not multiples of 128: reject the config, or keep them BF16 "
            "on both sides",
            ("error", "bf16"),
        ),
        "model_config": KeySpec(
            (str, _NULL),
            None,
            "path to a HuggingFace config.json describing the model (default: the built-in "
            "description matching policy.model_name)",
        ),
        "local": KeySpec(
            (Mapping, _NULL),
            None,
            "settings of the embedded CPU backend; validated by that backend's own schema",
        ),
    }
)
