"""The typed, frozen settings a validated config holds beyond its `Recipe` (issue 38).

`settings_of(cfg)` reads, once, every key the modules below the door (`nemo_jetrl.flow`, the
commands, the backends' verdicts) need and was reading from the raw tree itself: the model's
keys, MoE splits over ranks and routing replay, the refit flags, policy lag, the unmodelled
quantization keys, the IS-correction keys, the per-name BF16 lists. Each key's default lives
here, once; a section holds values, no rules (the rules across keys: `nemo_jetrl.config.validate`,
`layer_lists`, `nemo_jetrl.rl.correction`, `nemo_jetrl.flow.support` / `limits`).

A value the config gives is kept as given (the typed parse in `validate` has checked its type
for a valid config); a key that is absent, or that cannot be resolved, reads as its default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from nemo_jetrl.config import schema as S
from nemo_jetrl.config.layer_lists import ROLLOUT_KEY, TRAIN_KEY

DEFAULT_MAX_AGE = 1  # NeMo-RL's default grpo.async_grpo.max_trajectory_age_steps
# NeMo-RL main's AsyncRLConfig: the sampler when async_rl.sampler is absent, and every built-in
# sampler's default window (max_staleness_versions / max_lookahead_versions).
DEFAULT_SAMPLER = "in_order"
DEFAULT_SAMPLER_WINDOW = 1
_ABSENT = object()


def _value(cfg: Any, key: str, *, resolve: bool = True) -> Any:
    """The value at ``key`` as plain Python (None: absent or unresolvable; the validator names an
    unresolvable key). ``resolve=False`` keeps interpolations as written (for messages)."""
    try:
        v = OmegaConf.select(cfg, key, default=None)
        if isinstance(v, (DictConfig, ListConfig)):
            return OmegaConf.to_container(v, resolve=resolve)
    except Exception:  # a non-mapping on the way, an unresolvable value: validation's to report
        return None
    return v


def _int_over_one(v: Any) -> int:
    """A parallel size: the value when an int > 1, else 1."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 1 else 1


def _or(v: Any, default: Any) -> Any:
    return default if v is None else v


def _flag(v: Any, default: bool) -> bool:
    return default if v is None else v is True


@dataclass(frozen=True)
class ModelKeys:
    """Which model the config names."""

    name: Any
    """``policy.model_name``."""

    config: Any
    """``jetrl.model_config`` (a config.json path), or None."""

    local_config: Any
    """``jetrl.local.model_config`` (the local backend's model), or None."""

    @property
    def chosen_by(self) -> str:
        """The YAML key that chose the model the check read (the local model config first)."""
        if self.local_config:
            return "jetrl.local.model_config"
        if self.config:
            return "jetrl.model_config"
        return S.MODEL_NAME


@dataclass(frozen=True)
class MoeKeys:
    """Mixture-of-experts keys: splits over ranks, routing replay, Megatron's routing knobs."""

    megatron_experts: tuple[tuple[str, Any], ...]
    """(key, value) of Megatron's expert keys (`S.MEGATRON_MOE_KEYS`), as given."""

    vllm_tp: int
    """``vllm_cfg.tensor_parallel_size`` (1 unless an int > 1)."""

    vllm_ep: int
    """``vllm_cfg.expert_parallel_size`` (1 unless an int > 1)."""

    router_replay: Any
    """``policy.router_replay.enabled`` as given (replayed only when true)."""

    router_dtype: Any
    virtual_pipeline: Any
    capacity_factor: Any
    pad_to_capacity: Any


@dataclass(frozen=True)
class RefitKeys:
    """How NeMo-RL's refit quantizes: our patch and hook and their checks."""

    vllm_patch: bool
    hook: bool
    parity_check: bool
    rollback: bool

    @property
    def ours(self) -> bool:
        """Our refit hook quantizes the refit weights (the patch and the hook both on)."""
        return self.vllm_patch and self.hook


@dataclass(frozen=True)
class SamplerKeys:
    """``async_rl.sampler``: the staleness policy of NeMo-RL main's single-controller path."""

    name: Any
    """``async_rl.sampler.name`` (`DEFAULT_SAMPLER` when absent)."""
    window_key: str | None
    """The key that bounds its staleness (`S.SAMPLER_WINDOW_KEYS`; None: a custom sampler)."""
    window: Any
    """That key's value (`DEFAULT_SAMPLER_WINDOW` when absent; None: a custom sampler)."""
    window_given: bool
    """The config gives the window (else NeMo-RL's default applies)."""
    target: Any
    """``async_rl.sampler.target`` (a custom sampler's ``module:ClassName``), or None."""


@dataclass(frozen=True)
class PolicyLag:
    """Weights a trajectory may lag behind: ``grpo.async_grpo`` (the legacy async trainer) or,
    when ``grpo.async_grpo`` is null, ``async_rl.sampler`` (the single-controller path)."""

    async_enabled: bool
    max_age: Any
    """``max_trajectory_age_steps`` (`DEFAULT_MAX_AGE` when absent)."""
    in_flight: bool
    data_plane: bool
    """``data_plane.enabled`` is true (async GRPO with replay needs it off)."""
    sampler: SamplerKeys | None = None
    """The single-controller sampler when ``grpo.async_grpo`` is given as null (NeMo-RL's
    ``run_grpo_single_controller.py`` requires that, and ``run_grpo.py`` cannot run it); None
    otherwise (the legacy trainer never reads ``async_rl``)."""


@dataclass(frozen=True)
class CorrectionKeys:
    """``loss_fn``'s importance-sampling keys, as given (None: absent)."""

    enabled: Any
    kind: Any
    ratio_min: Any
    ratio_max: Any


@dataclass(frozen=True)
class LocalKeys:
    """What the commands read of ``jetrl.local`` before the local backend's own door
    (`nemo_jetrl.backends.local.config.LocalSettings` holds the whole section)."""

    device: Any
    """``jetrl.local.device`` as given (None: absent)."""
    rollout_engine: Any
    """``jetrl.local.rollout_engine`` ("hf" when absent)."""


@dataclass(frozen=True)
class Settings:
    """What the modules below the door read from a config, read once."""

    model: ModelKeys
    moe: MoeKeys
    refit: RefitKeys
    lag: PolicyLag
    correction: CorrectionKeys
    quant_cfg: tuple[tuple[str, Any], ...]
    """(key, value) of each of `S.QUANT_CFG_KEYS` (None: absent; interpolations as written)."""
    megatron_enabled: Any
    """``policy.megatron_cfg.enabled`` as given (False: NeMo-RL's DTensor policy trains)."""
    generation_backend: Any
    rollout_kws: tuple[str, ...] | None
    """``vllm_cfg.quantization_ignored_layer_kws`` (None: absent)."""
    train_kws: tuple[str, ...] | None
    """``jetrl.train_bf16_layer_kws`` (None: absent)."""
    allow_off_policy: bool
    local: LocalKeys
    optimizer_name: Any
    """``policy.optimizer.name`` as given (None: absent)."""
    megatron_tp: int = 1
    """``policy.megatron_cfg.tensor_model_parallel_size`` (1 unless an int > 1)."""
    megatron_etp: int | None = None
    """``policy.megatron_cfg.expert_tensor_parallel_size`` (None: absent, Megatron then uses
    the tensor-parallel size; 1 unless an int > 1)."""

    @property
    def megatron_off(self) -> bool:
        """The config turns NeMo-RL's Megatron policy off (its DTensor policy trains)."""
        return self.megatron_enabled is False


def _words(v: Any) -> tuple[str, ...] | None:
    """A per-name list (None: absent, or no list: the typed parse names it)."""
    return tuple(v) if isinstance(v, (list, tuple)) else None


def _sampler_of(cfg: Any) -> SamplerKeys | None:
    """`SamplerKeys` when ``grpo.async_grpo`` is given as null (absent: NeMo-RL's default
    block, which the single-controller path refuses), else None."""
    try:
        if OmegaConf.select(cfg, S.ASYNC_GRPO, default=_ABSENT) is not None:
            return None
    except Exception:  # a non-mapping on the way: validation's to report
        return None
    name = _or(_value(cfg, S.SAMPLER_NAME), DEFAULT_SAMPLER)
    key = S.SAMPLER_WINDOW_KEYS.get(name) if isinstance(name, str) else None
    given = _value(cfg, key) if key else None
    window = None if key is None else _or(given, DEFAULT_SAMPLER_WINDOW)
    return SamplerKeys(name, key, window, given is not None, _value(cfg, S.SAMPLER_TARGET))


def settings_of(cfg: Any) -> Settings:
    """The `Settings` of a loaded config (``cfg``: an OmegaConf config or a plain mapping);
    never raises, so the validator's hooks can read them before every key is known good."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(dict(cfg))

    def get(key: str) -> Any:
        return _value(cfg, key)

    age = get(S.ASYNC_AGE)
    return Settings(
        model=ModelKeys(get(S.MODEL_NAME), get("jetrl.model_config"), get(S.LOCAL_MODEL_CONFIG)),
        moe=MoeKeys(
            megatron_experts=tuple((k, get(k)) for k in S.MEGATRON_MOE_KEYS),
            vllm_tp=_int_over_one(get(S.VLLM_TP)),
            vllm_ep=_int_over_one(get(S.VLLM_EP)),
            router_replay=get(S.ROUTER_REPLAY),
            router_dtype=get(S.ROUTER_DTYPE),
            virtual_pipeline=get(S.VPP_SIZE),
            capacity_factor=get(S.MOE_CAPACITY),
            pad_to_capacity=get(S.MOE_PAD_TO_CAPACITY),
        ),
        refit=RefitKeys(
            vllm_patch=_flag(get("jetrl.vllm_patch"), False),
            hook=_flag(get("jetrl.refit_hook"), True),
            parity_check=_flag(get("jetrl.refit_parity_check"), True),
            rollback=_flag(get("jetrl.refit_rollback"), True),
        ),
        lag=PolicyLag(
            async_enabled=get(S.ASYNC_ENABLED) is True,
            max_age=DEFAULT_MAX_AGE if age is None else age,
            in_flight=get(S.ASYNC_IN_FLIGHT) is True,
            data_plane=get(S.DATA_PLANE) is True,
            sampler=_sampler_of(cfg),
        ),
        correction=CorrectionKeys(
            get(S.IS_CORRECTION), get(S.TIS_TYPE), get(S.TIS_RATIO_MIN), get(S.TIS_RATIO)
        ),
        quant_cfg=tuple((k, _value(cfg, k, resolve=False)) for k in S.QUANT_CFG_KEYS),
        megatron_enabled=get(S.MEGATRON_ENABLED),
        generation_backend=get(S.GEN_BACKEND),
        rollout_kws=_words(get(ROLLOUT_KEY)),
        train_kws=_words(get(TRAIN_KEY)),
        allow_off_policy=bool(get("jetrl.allow_off_policy")),
        optimizer_name=get("policy.optimizer.name"),
        local=LocalKeys(get("jetrl.local.device"), _or(get("jetrl.local.rollout_engine"), "hf")),
        megatron_tp=_int_over_one(get(S.MEGATRON_TP)),
        megatron_etp=None if get(S.MEGATRON_ETP) is None else _int_over_one(get(S.MEGATRON_ETP)),
    )
