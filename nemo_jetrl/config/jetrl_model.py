"""Our own ``jetrl:`` section, typed: every key known, an unknown key is an error (with a
close-match suggestion). Defaults here are the only ones (`default_of`); each field's docstring
is its meaning, shown in docs/configs.md. ``jetrl.local`` is checked for shape here and key by
key by the local backend's own model (`nemo_jetrl.backends.local.config`).
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from nemo_jetrl.config.typed import (
    OurSection,
    any_section,
    choice,
    count,
    flag,
    rule,
    section,
    text,
    words,
)
from nemo_jetrl.recipe import PRESET_NAMES
from nemo_jetrl.recipe_parts import (
    KV_CALIBRATION_RULES,
    KV_DATA_FRACTION,
    KV_MARGIN,
    KV_MASK,
    KV_MASKS,
    KV_PERCENTILE,
    KV_REDUCTIONS,
    KV_SCALE_SOURCES,
)

_DOCS = ConfigDict(use_attribute_docstrings=True)

#: ``policy.model_name`` of the local backend's configs (examples/configs/local/base.yaml): the
#: model is built from ``jetrl.local.model_config``, never downloaded.
LOCAL_MODEL_NAME = "nemo-jetrl/local-tiny-llama"


def _kv(tp: Any, name: str) -> Any:
    """A KV-calibration key: its type here, its range from `KV_CALIBRATION_RULES` (shared with
    `KvCalibration` and `kvcache.CalibrationSettings`, which cannot import this package)."""
    ok, what = KV_CALIBRATION_RULES[name]
    return rule(tp, what, ok=ok)


class KvCalibrationSection(OurSection):
    """``jetrl.kv_calibration``: trainer-side Q/K/V scale calibration."""

    model_config = OurSection.model_config | _DOCS

    enabled: flag() = True  # type: ignore[valid-type]
    """recalibrate Q/K/V scales on the trainer every step"""
    data_fraction: _kv(float, "data_fraction") = KV_DATA_FRACTION  # type: ignore[valid-type]
    """fraction (0, 1] of the step's sequences the observers see"""
    percentile: _kv(float, "percentile") = KV_PERCENTILE  # type: ignore[valid-type]
    """percentile (0, 100] of per-micro-batch amax; 100 = max"""
    margin: _kv(float, "margin") = KV_MARGIN  # type: ignore[valid-type]
    """factor >= 1 applied to amax before the scale"""
    mask: choice(*KV_MASKS) = KV_MASK  # type: ignore[valid-type]
    """tokens observed: response only, all real tokens, or none masked (with padding)"""
    reduction: choice(*KV_REDUCTIONS, None) = None  # type: ignore[valid-type]
    """how per-micro-batch amax samples combine: max, or the percentile above; null = max when
    percentile is 100, else percentile"""
    include_q: flag(null=True) = None  # type: ignore[valid-type]
    """also calibrate q_scale (attention kernels taking FP8 queries); null = the backend decides
    (local: true; NeMo-RL: when NeMo-RL asks)"""
    micro_batch_size: _kv(int | None, "micro_batch_size") = None  # type: ignore[valid-type]
    """sequences per calibration forward pass (> 0, one amax sample each); null = the backend's
    default (local: 32; NeMo-RL: its calibration batch, else policy.logprob_batch_size)"""


class JetrlSection(OurSection):
    """``jetrl:``: what NeMo-RL has no key for."""

    model_config = OurSection.model_config | _DOCS

    recipe: choice(*PRESET_NAMES, None) = None  # type: ignore[valid-type]
    """the recipe this config is meant to be (a label); the NeMo-RL keys decide, and `jetrl
    check` warns when they describe something else"""
    run_name: text("a run name (a string)", null=True) = None  # type: ignore[valid-type]
    """a name for this run: `jetrl compare` labels the run with it (default: the recipe's name);
    the NeMo-RL backend logs it with the hyperparameters (``jetrl.run_name``)"""
    vllm_patch: flag() = False  # type: ignore[valid-type]
    """apply nemo_jetrl's vLLM patch: vLLM quantizes activations with TE's formula and loads
    trainer-quantized weights without requantizing"""
    onpolicy_kv: flag() = False  # type: ignore[valid-type]
    """the trainer's attention applies the rollout's FP8 KV quantization (same scales)"""
    kv_scale_source: choice(*(s for s in KV_SCALE_SOURCES if s != "none"), None) = None  # type: ignore[valid-type]
    """where FP8 KV scales come from; null = trainer_calibrated when kv_calibration.enabled,
    else dynamic"""
    kv_calibration: section(KvCalibrationSection) = None  # type: ignore[valid-type]
    """trainer-side Q/K/V scale calibration (`KvCalibrationSection`)"""
    refit_hook: flag() = True  # type: ignore[valid-type]
    """NeMo-RL backend: refit weights are quantized by nemo_jetrl.fp8 inside NeMo-RL's vLLM
    worker (our hook) instead of NeMo-RL's own cast; false leaves NeMo-RL's, whose bytes differ
    from TE's with FP32 scales"""
    refit_parity_check: flag() = True  # type: ignore[valid-type]
    """after each refit, compare the rollout engine's FP8 weights with the trainer's"""
    refit_rollback: flag() = True  # type: ignore[valid-type]
    """snapshot the rollout engine's model before each refit and restore it (checked bit for
    bit) if the refit fails once tensors reached it; costs one copy of the model's tensors
    during the refit (on the GPU when it fits, else host memory)"""
    allow_off_policy: flag() = False  # type: ignore[valid-type]
    """let `jetrl train` run a recipe that `jetrl check` finds off-policy"""
    train_num_first_layers_in_bf16: count(0) = 0  # type: ignore[valid-type]
    """leading decoder layers kept BF16 in training (Megatron's num_layers_at_start_in_bf16)"""
    train_bf16_layer_kws: words(  # type: ignore[valid-type]
        "a list of non-empty strings (words of linear names)"
    ) = None
    """decoder linears kept BF16 in training: those whose HF name contains one of these words
    (the training twin of vllm_cfg.quantization_ignored_layer_kws)"""
    train_num_last_layers_in_bf16: count(0) = 0  # type: ignore[valid-type]
    """trailing decoder layers kept BF16 in training (Megatron's num_layers_at_end_in_bf16)"""
    unaligned_layers: choice("error", "bf16") = "error"  # type: ignore[valid-type]
    """linears whose dims are not multiples of 128: reject the config, or keep them BF16 on both
    sides"""
    model_config_path: text("a path to a config.json, or null", null=True) = Field(  # type: ignore[valid-type]
        default=None, alias="model_config"
    )
    """path to a HuggingFace config.json describing the model (default: the built-in description
    matching policy.model_name)"""
    not_typos: words("a list of dotted keys, e.g. [grpo.max_num_step]") = None  # type: ignore[valid-type]
    """keys one typo from a NeMo-RL key jetrl reads that are meant as written (a NeMo-RL key
    jetrl does not know yet): not refused at a run's launch nor warned about"""
    local: any_section() = None  # type: ignore[valid-type]
    """settings of the embedded CPU backend; validated by that backend's own schema"""


def key_name(field: str) -> str:
    """The YAML key of a field (``model_config`` is a reserved name in pydantic)."""
    alias = JetrlSection.model_fields[field].alias
    return alias or field


def default_of(path: str) -> Any:
    """The default of a ``jetrl.*`` key (dotted path), or None when it has none."""
    parts = path.split(".")[1:]
    model: Any = JetrlSection
    if parts[:1] == ["kv_calibration"]:
        model, parts = KvCalibrationSection, parts[1:]
    if len(parts) != 1:
        return None
    name = "model_config_path" if model is JetrlSection and parts[0] == "model_config" else parts[0]
    fld = model.model_fields.get(name)
    return None if fld is None else fld.default
