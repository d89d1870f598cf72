"""Reading a loaded config: values, the problems of rules across keys, the Recipe, the model.

Each key's type and values are checked once, by the typed schema (`nemo_jetrl.config.typed`);
`_Reader` reads values (a default where a key is absent or cannot be resolved) and records the
issues the rules across keys find, never raising, so that validation reports everything at once.
`read_recipe` maps NeMo-RL's keys and the ``jetrl:`` section onto a `Recipe` (reading a
mistyped key as its default: the typed parse has named it; see docs/configs.md for the table).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_jetrl.config import schema as S
from nemo_jetrl.config.issues import ConfigError, ConfigIssue
from nemo_jetrl.config.layer_lists import ROLLOUT_KEY, TRAIN_KEY, read_kws
from nemo_jetrl.config.overrides import _exists
from nemo_jetrl.config.sections import NO_SECTIONS, BackendSection, SectionProviders
from nemo_jetrl.recipe import Recipe, matching_preset
from nemo_jetrl.recipe_parts import (
    KV_DATA_FRACTION,
    KV_MARGIN,
    KV_MASK,
    KV_PERCENTILE,
    KvCalibration,
    SideRecipe,
)

# ---------------------------------------------------------------------------------------------
# reading with a record of problems


class _Reader:
    """Reads values from a config and records issues instead of raising."""

    def __init__(self, cfg: DictConfig, sections: SectionProviders = NO_SECTIONS) -> None:
        self.cfg = cfg
        self.issues: list[ConfigIssue] = []
        self._sections = sections
        self._loaded: dict[str, BackendSection] = {}

    def section(self, name: str) -> BackendSection | None:
        """The backend hooks for ``jetrl.<name>`` (loaded once), or None when none were given."""
        if name not in self._loaded and name in self._sections:
            self._loaded[name] = self._sections[name]()
        return self._loaded.get(name)

    def get(self, path: str, default: Any = None) -> Any:
        if not _exists(self.cfg, path):
            return default
        try:
            val = OmegaConf.select(self.cfg, path, throw_on_missing=True)
            if isinstance(val, (DictConfig, ListConfig)):
                return OmegaConf.to_container(val, resolve=True)
        except OmegaConfBaseException:
            return default  # `load.unresolvable` names every such key once
        return val

    def has(self, path: str) -> bool:
        return _exists(self.cfg, path)

    def error(self, path: str, message: str, allowed: Sequence[Any] = ()) -> None:
        self.issues.append(ConfigIssue(path, message, tuple(allowed)))

    def warn(self, path: str, message: str, allowed: Sequence[Any] = ()) -> None:
        self.issues.append(ConfigIssue(path, message, tuple(allowed), "warning"))

    def note(self, path: str, message: str) -> None:
        self.issues.append(ConfigIssue(path, message, (), "note"))


def read_recipe(r: _Reader) -> Recipe:
    """Build the Recipe from the keys (issues recorded in `r`, defaults where invalid)."""
    train = _train_side(r)
    rollout = _rollout_side(r)
    fp8_roll = rollout.fp8_linears
    kv_fp8 = str(r.get(S.VLLM_KV_DTYPE, "auto")).startswith("fp8") and fp8_roll
    if r.get(S.GEN_BACKEND, "vllm") == "megatron":
        # NeMo-RL's Megatron generation samples with the training model itself: the rollout
        # is the training forward (vllm_cfg does not apply), with a BF16 KV cache.
        rollout, kv_fp8 = train.with_(fp8_param=False), False
    cal_enabled = r.get("jetrl.kv_calibration.enabled", True) is not False
    src = _kv_scale_source(r, kv_fp8, cal_enabled)
    onpolicy = r.get("jetrl.onpolicy_kv", False) is True
    cal = _kv_calibration(r, cal_enabled)
    recipe = Recipe(
        name="custom",
        train=train,
        rollout=rollout,
        kv_cache_dtype="fp8" if kv_fp8 else "auto",
        kv_scale_source=src,
        onpolicy_kv=onpolicy and kv_fp8,
        kv_calibration=cal,
        unaligned_layers_bf16=r.get("jetrl.unaligned_layers", "error") == "bf16",
    )
    # Name it after the declared preset when the keys match it, else after any preset they
    # match (a config without the label), else "custom".
    label = r.get("jetrl.recipe", None)
    name = matching_preset(recipe, prefer=label if isinstance(label, str) else None)
    return recipe.with_(name=name) if name else recipe


def _train_side(r: _Reader) -> SideRecipe:
    """The training side, from Megatron's fp8_cfg and the TE scale env var."""
    fp8_train = r.get(S.FP8_ENABLED, False) is True
    fmt = r.get(S.FP8_FORMAT, "e4m3")
    scaling = r.get(S.FP8_RECIPE, "blockwise")
    fp32_env = str(r.get(S.FP32_SCALES_KEY, "0")) == "1"
    return SideRecipe(
        fp8_linears=fp8_train,
        fmt=fmt if fmt in S.FP8_FORMATS else "e4m3",
        scaling=scaling if scaling in S.FP8_RECIPES else "blockwise",
        pow2_weight_scales=not fp32_env,
        pow2_activation_scales=not fp32_env,
        quantizer="te",
        bf16_first_layers=_safe_count(r.get("jetrl.train_num_first_layers_in_bf16", 0)),
        bf16_last_layers=_safe_count(r.get("jetrl.train_num_last_layers_in_bf16", 0)),
        bf16_layer_kws=read_kws(r, TRAIN_KEY),
        fp8_param=fp8_train and r.get(S.FP8_PARAM, False) is True,
    )


def _rollout_side(r: _Reader) -> SideRecipe:
    """The vLLM rollout side, from vllm_cfg and ``jetrl.vllm_patch``."""
    fp8_roll = r.get(S.VLLM_PRECISION, "bfloat16") == "fp8"
    patch = r.get("jetrl.vllm_patch", False) is True
    pow2_w = r.get(S.VLLM_POW2_W, False) is True
    pow2_a = r.get(S.VLLM_POW2_A, False) is True
    if patch and fp8_roll:
        # Our patch quantizes activations with the weights' scale rule (pow2_activation true
        # with it is refused: `validate._check_patch_activation_scales`).
        pow2_a = pow2_w
    return SideRecipe(
        fp8_linears=fp8_roll,
        fmt="e4m3",
        scaling="mxfp8" if r.get(S.VLLM_IS_MX, False) is True else "blockwise",
        pow2_weight_scales=pow2_w,
        pow2_activation_scales=pow2_a,
        quantizer="jetrl" if patch and fp8_roll else "vllm",
        bf16_first_layers=_safe_count(r.get(S.VLLM_FIRST_BF16, 0)),
        bf16_last_layers=_safe_count(r.get(S.VLLM_LAST_BF16, 0)),
        bf16_layer_kws=read_kws(r, ROLLOUT_KEY),
        use_deep_gemm=r.get(S.VLLM_DEEP_GEMM, False) is True,
    )


def _kv_scale_source(r: _Reader, kv_fp8: bool, cal_enabled: bool) -> str:
    """``jetrl.kv_scale_source``: none without an FP8 KV cache; an unknown value falls back to
    trainer_calibrated (dynamic when calibration is off)."""
    src = r.get("jetrl.kv_scale_source", None)
    if not kv_fp8:
        return "none"
    if src not in ("trainer_calibrated", "checkpoint", "dynamic", "unit"):
        return "trainer_calibrated" if cal_enabled else "dynamic"
    return src


def _kv_calibration(r: _Reader, cal_enabled: bool) -> KvCalibration:
    """``jetrl.kv_calibration``; the defaults when its values are invalid."""
    try:
        return KvCalibration(
            enabled=cal_enabled,
            data_fraction=r.get("jetrl.kv_calibration.data_fraction", KV_DATA_FRACTION),
            percentile=r.get("jetrl.kv_calibration.percentile", KV_PERCENTILE),
            margin=r.get("jetrl.kv_calibration.margin", KV_MARGIN),
            mask=r.get("jetrl.kv_calibration.mask", KV_MASK),
            reduction=r.get("jetrl.kv_calibration.reduction", None),
            include_q=r.get("jetrl.kv_calibration.include_q", None),
            micro_batch_size=r.get("jetrl.kv_calibration.micro_batch_size", None),
        )
    except (ValueError, TypeError):
        return KvCalibration()  # the problem is already recorded by _check_kv_calibration


def _safe_count(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def _arch(r: _Reader) -> tuple[Any, bool]:
    """(ModelArch or None, ok); a bad jetrl.model_config is recorded as an error. A
    state-space model other than Nemotron-H (`arch.state_space`) is None: the check notes its
    generic stand-in for BF16 (`flow.pipeline`); `flow.support` refuses any with FP8."""
    from nemo_jetrl.arch import ArchError, ModelArch, StateSpaceArch, resolve_arch

    model, path = r.get(S.MODEL_NAME, None), r.get("jetrl.model_config", None)
    key = "jetrl.model_config"
    if not path and isinstance(r.get("jetrl.local", None), dict):
        # A local-backend config: the model is the one that backend builds, never a stand-in.
        path, key = _local_model_config(r), "jetrl.local.model_config"
    try:
        if path:
            return ModelArch.from_json(path, key=key), True
        return resolve_arch(model if isinstance(model, str) else None, None), True
    except StateSpaceArch as exc:
        if key != "jetrl.model_config":  # the local backend builds its model from arch
            r.error(key, str(exc))
            return None, False
        return None, True
    except ArchError as exc:
        r.error(exc.key or key, str(exc))
        return None, False


def _local_model_config(r: _Reader) -> str | None:
    """The local backend's model config.json (its `BackendSection.model_config`), or None."""
    section = r.section("local")
    return None if section is None else section.model_config(r.get("jetrl.local", None))


def arch_from_config(cfg: DictConfig, sections: SectionProviders = NO_SECTIONS) -> Any:
    """The model's ModelArch (jetrl.model_config, else the local backend's model when ``sections``
    has it, else the built-in for policy.model_name, else None); ConfigError when the model
    config cannot be read."""
    r = _Reader(cfg, sections)
    arch, ok = _arch(r)
    if not ok:
        raise ConfigError(r.issues)
    return arch
