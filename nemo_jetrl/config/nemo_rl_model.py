"""NeMo-RL's sections of a GRPO config, typed for the keys this package reads.

Each section is a `NemoSection`: its shape (a mapping, or null) and the types and ranges of
the keys we read are checked (absent keys read as None: their defaults live with their readers); every other NeMo-RL key passes, so we are never stricter than
NeMo-RL on what we do not read. Sizes carry a bound no machine can exceed, so that ``lr=.inf``
or ``num_prompts_per_step=1e22`` are refused before any work starts. Where NeMo-RL is laxer
than us on a key we read (its TypedDicts are not enforced at load time, and its pydantic
``MasterConfig`` on main types only the sections), ours stays: the NeMo-RL tier records each
such case (tests/backends/test_nemo_rl_schema.py). The ``jetrl:`` section is ours and
strict (`nemo_jetrl.config.jetrl_model`); checks across keys run after this parse
(`nemo_jetrl.config.validate`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from nemo_jetrl.config import schema as S
from nemo_jetrl.config.jetrl_model import JetrlSection
from nemo_jetrl.config.typed import (
    NemoSection,
    any_section,
    choice,
    count,
    flag,
    number,
    rule,
    section,
    text,
    words,
)

# Responses (prompts x generations) one step may hold: 2**20 sequences is beyond any machine's
# memory for a real model, so a larger value is a typo (1e22), never a plan.
MAX_RESPONSES_PER_STEP = 1 << 20
# Steps, periods and token counts above this are typos too (2**31: int32 counters).
MAX_COUNT = (1 << 31) - 1
# torch.manual_seed accepts [0, 2**64); runs derive seeds by adding offsets below 2**32 (per
# step, per generator), so the run's seed stays below 2**63.
MAX_SEED = (1 << 63) - 1

POSITIVE = number("a finite number > 0", Field(gt=0))
NON_NEGATIVE = number("a finite number >= 0", Field(ge=0))
FRACTION = number("a number in [0, 1)", Field(ge=0, lt=1))
RESPONSES = count(1, MAX_RESPONSES_PER_STEP)
BETAS = rule(
    list[Annotated[float, Field(ge=0, lt=1)]] | None,
    "[b1, b2] in [0, 1), or null",
    Field(min_length=2, max_length=2),
)
# TE reads the variable as a string; NeMo-RL's YAML may write the number.
FP32_SCALES_FLAG = rule(
    str | int | None,
    "'1' (FP32 scales) or '0' (power-of-two scales): TE treats anything but '1' as "
    "power-of-two scales, so write one of them",
    ok=lambda v: str(v) in S.ENV_FLAG_VALUES,
    allowed=S.ENV_FLAG_VALUES,
)


class VllmCfg(NemoSection):
    """``policy.generation.vllm_cfg``."""

    precision: choice(*S.VLLM_PRECISIONS) = None  # type: ignore[valid-type]
    kv_cache_dtype: choice(*S.VLLM_KV_DTYPES) = None  # type: ignore[valid-type]
    pow2_weight_scaling_factors: flag(null=True) = None  # type: ignore[valid-type]
    pow2_activation_scaling_factors: flag(null=True) = None  # type: ignore[valid-type]
    use_deep_gemm: flag(null=True) = None  # type: ignore[valid-type]
    is_mx: flag(null=True) = None  # type: ignore[valid-type]
    async_engine: flag(null=True) = None  # type: ignore[valid-type]
    num_first_layers_in_bf16: count(0, null=True) = None  # type: ignore[valid-type]
    num_last_layers_in_bf16: count(0, null=True) = None  # type: ignore[valid-type]
    tensor_parallel_size: count(1, null=True) = None  # type: ignore[valid-type]
    quantization_ignored_layer_kws: words(  # type: ignore[valid-type]
        "a list of non-empty strings (words of linear names)"
    ) = None


class Generation(NemoSection):
    """``policy.generation``."""

    backend: text(null=True) = None  # type: ignore[valid-type]
    temperature: POSITIVE = None  # type: ignore[valid-type]
    max_new_tokens: count(1, MAX_COUNT, null=True) = None  # type: ignore[valid-type]
    vllm_cfg: section(VllmCfg) = None  # type: ignore[valid-type]


class OptimizerKwargs(NemoSection):
    """``policy.optimizer.kwargs`` (torch's AdamW arguments)."""

    lr: POSITIVE = None  # type: ignore[valid-type]
    weight_decay: NON_NEGATIVE = None  # type: ignore[valid-type]
    eps: POSITIVE = None  # type: ignore[valid-type]
    betas: BETAS = None  # type: ignore[valid-type]


class Optimizer(NemoSection):
    """``policy.optimizer`` (DTensor path); null under Megatron."""

    name: text(null=True) = None  # type: ignore[valid-type]
    kwargs: section(OptimizerKwargs) = None  # type: ignore[valid-type]


class Fp8Cfg(NemoSection):
    """``policy.megatron_cfg.fp8_cfg``; its values are checked against `S.FP8_FORMATS` /
    `S.FP8_RECIPES` only when ``enabled`` (a rule across keys, in `validate`)."""

    enabled: flag(null=True) = None  # type: ignore[valid-type]
    fp8: text(null=True) = None  # type: ignore[valid-type]
    fp8_recipe: text(null=True) = None  # type: ignore[valid-type]
    fp8_param: flag(null=True) = None  # type: ignore[valid-type]


class EnvVars(NemoSection):
    """``policy.megatron_cfg.env_vars``."""

    NVTE_FP8_BLOCK_SCALING_FP32_SCALES: FP32_SCALES_FLAG = None  # type: ignore[valid-type]


class MegatronOptimizer(NemoSection):
    """``policy.megatron_cfg.optimizer`` (checked only: the local backend trains with
    ``policy.optimizer``)."""

    lr: POSITIVE = None  # type: ignore[valid-type]
    min_lr: NON_NEGATIVE = None  # type: ignore[valid-type]
    weight_decay: NON_NEGATIVE = None  # type: ignore[valid-type]
    adam_eps: POSITIVE = None  # type: ignore[valid-type]
    adam_beta1: FRACTION = None  # type: ignore[valid-type]
    adam_beta2: FRACTION = None  # type: ignore[valid-type]


class MegatronCfg(NemoSection):
    """``policy.megatron_cfg``."""

    enabled: flag(null=True) = None  # type: ignore[valid-type]
    pipeline_model_parallel_size: count(1, null=True) = None  # type: ignore[valid-type]
    # read by the block-grid rule (`flow.megatron_layout`): "8" as a string was judged as 1
    tensor_model_parallel_size: count(1, null=True) = None  # type: ignore[valid-type]
    expert_tensor_parallel_size: count(1, null=True) = None  # type: ignore[valid-type]
    fp8_cfg: section(Fp8Cfg) = None  # type: ignore[valid-type]
    env_vars: section(EnvVars) = None  # type: ignore[valid-type]
    optimizer: section(MegatronOptimizer) = None  # type: ignore[valid-type]


class RouterReplay(NemoSection):
    """``policy.router_replay`` (MoE routing replay, R3)."""

    enabled: flag(null=True) = None  # type: ignore[valid-type]


_PRECISION = (
    "the training dtype, one of the allowed values; FP8 is not a dtype here: FP8 training is "
    f"{S.FP8_ENABLED}, an FP8 rollout {S.VLLM_PRECISION}, and jetrl.recipe (e.g. jetrl) sets "
    "both (`jetrl align`)"
)


class Policy(NemoSection):
    """``policy``."""

    model_name: text("a HF model name or directory", null=True) = None  # type: ignore[valid-type]
    precision: choice(*S.POLICY_PRECISIONS, None, what=_PRECISION) = None  # type: ignore[valid-type]
    """The training dtype (NeMo-RL's workers fail at setup on another; FP8 is jetrl.recipe's)."""
    max_grad_norm: number("a finite number > 0, or null", Field(gt=0), null=True) = None  # type: ignore[valid-type]
    train_global_batch_size: RESPONSES = None  # type: ignore[valid-type]
    """Responses per optimizer step (NeMo-RL: a GRPO step of N responses takes N / this)."""
    max_total_sequence_length: count(1, MAX_COUNT, null=True) = None  # type: ignore[valid-type]
    """Prompt + response tokens a sequence may hold (NeMo-RL cuts responses there)."""
    optimizer: section(Optimizer) = None  # type: ignore[valid-type]
    generation: section(Generation) = None  # type: ignore[valid-type]
    megatron_cfg: section(MegatronCfg) = None  # type: ignore[valid-type]
    router_replay: section(RouterReplay) = None  # type: ignore[valid-type]


class AsyncGrpo(NemoSection):
    """``grpo.async_grpo``: the policy lag a verdict names (`nemo_jetrl.flow.limits`)."""

    enabled: flag(null=True) = None  # type: ignore[valid-type]
    max_trajectory_age_steps: count(0, MAX_COUNT, null=True) = None  # type: ignore[valid-type]
    in_flight_weight_updates: flag(null=True) = None  # type: ignore[valid-type]


class Grpo(NemoSection):
    """``grpo``."""

    num_prompts_per_step: RESPONSES = None  # type: ignore[valid-type]
    num_generations_per_prompt: RESPONSES = None  # type: ignore[valid-type]
    max_num_steps: count(0, MAX_COUNT) = None  # type: ignore[valid-type]
    # NeMo-RL validates when val_period > 0; its own configs write -1 for "never".
    val_period: count(-1, MAX_COUNT) = None  # type: ignore[valid-type]
    val_at_start: flag() = None  # type: ignore[valid-type]
    seed: count(0, MAX_SEED) = None  # type: ignore[valid-type]
    normalize_rewards: flag() = None  # type: ignore[valid-type]
    use_leave_one_out_baseline: flag() = None  # type: ignore[valid-type]
    async_grpo: section(AsyncGrpo) = None  # type: ignore[valid-type]


class Sampler(NemoSection):
    """``async_rl.sampler``: NeMo-RL main's staleness policy (its discriminated union on
    ``name``); the window keys are its NonNegativeInt fields."""

    name: choice(*S.SAMPLERS) = None  # type: ignore[valid-type]
    max_staleness_versions: count(0, MAX_COUNT) = None  # type: ignore[valid-type]
    max_lookahead_versions: count(0, MAX_COUNT) = None  # type: ignore[valid-type]


class AsyncRl(NemoSection):
    """``async_rl``: the single-controller path's knobs (main); the policy lag a verdict names
    (`nemo_jetrl.flow.limits`) is its sampler's. The legacy trainers never read it."""

    sampler: section(Sampler) = None  # type: ignore[valid-type]


class LossFn(NemoSection):
    """``loss_fn``: NeMo-RL's ClippedPGLossConfig keys, one rule each (defaults as NeMo-RL's).
    The importance-sampling rules across keys are `nemo_jetrl.rl.correction`'s."""

    ratio_clip_min: NON_NEGATIVE = None  # type: ignore[valid-type]
    ratio_clip_max: NON_NEGATIVE = None  # type: ignore[valid-type]
    ratio_clip_c: number(  # type: ignore[valid-type]
        "a finite number > 1 (usually 3), or null to disable dual clipping", Field(gt=1), null=True
    ) = None
    reference_policy_kl_penalty: number("a finite number (0 disables the KL penalty)") = None  # type: ignore[valid-type]
    reference_policy_kl_type: choice(*S.KL_TYPES) = None  # type: ignore[valid-type]
    kl_input_clamp_value: number("a finite number > 0, or null", Field(gt=0), null=True) = None  # type: ignore[valid-type]
    kl_output_clamp_value: number("a finite number > 0, or null", Field(gt=0), null=True) = None  # type: ignore[valid-type]
    use_on_policy_kl_approximation: flag(null=True) = None  # type: ignore[valid-type]
    token_level_loss: flag(null=True) = None  # type: ignore[valid-type]
    use_importance_sampling_correction: flag(null=True) = None  # type: ignore[valid-type]
    sequence_level_importance_ratios: flag(null=True) = None  # type: ignore[valid-type]
    truncated_importance_sampling_type: text(  # type: ignore[valid-type]
        "a string (tis, icepop, seq-mask-tis), or null", null=True
    ) = None
    truncated_importance_sampling_ratio: number("a finite number, or null", null=True) = None  # type: ignore[valid-type]
    truncated_importance_sampling_ratio_min: number("a finite number, or null", null=True) = None  # type: ignore[valid-type]


class Checkpointing(NemoSection):
    """``checkpointing``."""

    enabled: flag() = None  # type: ignore[valid-type]
    checkpoint_dir: text("a path, or null", null=True) = None  # type: ignore[valid-type]
    save_period: count(1, MAX_COUNT) = None  # type: ignore[valid-type]
    keep_top_k: count(1, MAX_COUNT, null=True) = None  # type: ignore[valid-type]


class Logger(NemoSection):
    """``logger``."""

    log_dir: text("a non-empty directory path", non_empty=True) = None  # type: ignore[valid-type]


class RunConfig(NemoSection):
    """A whole GRPO config: NeMo-RL's sections (``data``, ``env``, ``cluster``: shape only) and
    ours (``jetrl``, `nemo_jetrl.config.jetrl_model`)."""

    # NeMo-RL's MasterConfig requires these sections as mappings: null is refused as there
    # (absent is allowed: the local backend's configs leave most of them out).
    policy: section(Policy, null=False) = None  # type: ignore[valid-type]
    grpo: section(Grpo, null=False) = None  # type: ignore[valid-type]
    loss_fn: section(LossFn, null=False) = None  # type: ignore[valid-type]
    checkpointing: section(Checkpointing, null=False) = None  # type: ignore[valid-type]
    logger: section(Logger, null=False) = None  # type: ignore[valid-type]
    data: any_section(null=False) = None  # type: ignore[valid-type]
    env: any_section(null=False) = None  # type: ignore[valid-type]
    cluster: any_section(null=False) = None  # type: ignore[valid-type]
    async_rl: section(AsyncRl) = None  # type: ignore[valid-type]
    jetrl: section(JetrlSection) = None  # type: ignore[valid-type]


RUN_SECTIONS = tuple(RunConfig.model_fields)
"""The top-level sections of a GRPO run: a file with none of them is a mistake (a typo'd file,
the wrong file), never a run of defaults."""


ABSENT = object()


def value_at(model: Any, path: str) -> Any:
    """The value the config sets at dotted ``path`` of a parsed model, or `ABSENT` (a key or a
    section on the way not given: every default stays with the code that reads the key)."""
    node = model
    for part in path.split("."):
        if node is None or part not in node.model_fields_set:
            return ABSENT
        node = getattr(node, part)
    return node
