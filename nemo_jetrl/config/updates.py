"""Recipe -> config keys (the inverse of `recipe_from_config`), for `jetrl align` and the
NeMo-RL translation: `recipe_to_config_updates`, `vllm_cfg_for`, `minimal_updates`,
`merge_updates`, and `nemo_rl_setup_updates` (what NeMo-RL's grpo.setup asserts)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nemo_jetrl.config import schema as S
from nemo_jetrl.config.jetrl_model import default_of
from nemo_jetrl.config.overrides import _MISSING, _exists
from nemo_jetrl.config.reader import _Reader
from nemo_jetrl.recipe import PRESET_NAMES, Recipe


def recipe_to_config_updates(recipe: Recipe) -> dict[str, Any]:
    """Nested dict of the NeMo-RL and `jetrl:` keys that express `recipe` (merge into a config).

    The inverse of `recipe_from_config` for every field a config can express that changes numbers
    (a BF16 rollout's scale flags are not written: they have no effect there).
    """
    t, ro = recipe.train, recipe.rollout
    fp32 = not (t.pow2_weight_scales and t.pow2_activation_scales)
    return {
        "policy": {
            "megatron_cfg": {
                "fp8_cfg": {
                    "enabled": t.fp8_linears,
                    "fp8": t.fmt,
                    "fp8_recipe": t.scaling,
                    "fp8_param": t.fp8_param,
                },
                "env_vars": {S.FP32_SCALES_ENV: "1" if fp32 else "0"},
            },
            "generation": {
                "vllm_cfg": {"is_mx": False, **vllm_cfg_for(recipe)}  # align turns MXFP8 off too
            },
        },
        "jetrl": {
            "recipe": recipe.name if recipe.name in PRESET_NAMES else None,
            "vllm_patch": ro.fp8_linears and ro.quantizer == "jetrl",
            "onpolicy_kv": recipe.onpolicy_kv,
            "kv_scale_source": _kv_source_key(recipe),
            "kv_calibration": {
                "enabled": recipe.kv_calibration.enabled,
                "data_fraction": recipe.kv_calibration.data_fraction,
                "percentile": recipe.kv_calibration.percentile,
                "margin": recipe.kv_calibration.margin,
                "mask": recipe.kv_calibration.mask,
                "reduction": recipe.kv_calibration.reduction,
                "include_q": recipe.kv_calibration.include_q,
                "micro_batch_size": recipe.kv_calibration.micro_batch_size,
            },
            "train_num_first_layers_in_bf16": t.bf16_first_layers,
            "train_bf16_layer_kws": list(t.bf16_layer_kws) or None,
            "train_num_last_layers_in_bf16": t.bf16_last_layers,
            "unaligned_layers": "bf16" if recipe.unaligned_layers_bf16 else "error",
        },
    }


def vllm_cfg_for(recipe: Recipe, unquantized_precision: str = "bfloat16") -> dict[str, Any]:
    """The ``policy.generation.vllm_cfg`` keys expressing the recipe's rollout side and KV cache.

    ``unquantized_precision`` is the ``precision`` written when the rollout's linears are not
    FP8 (a translation keeps the config's own value, e.g. float16).
    """
    ro = recipe.rollout
    # Under our patch the weights' rule covers activations too and NeMo-RL's own activation
    # patch stays off (see `read_recipe`).
    patched = ro.fp8_linears and ro.quantizer == "jetrl"
    # A BF16 rollout has no scales: its pow2 keys are left as the config has them (writing
    # pow2_activation_scaling_factors=true would arm NeMo-RL v0.7.0's own activation patch,
    # which crashes vLLM start-up there once FP8 is turned on).
    scales = (
        {
            "pow2_weight_scaling_factors": ro.pow2_weight_scales,
            "pow2_activation_scaling_factors": ro.pow2_activation_scales and not patched,
        }
        if ro.fp8_linears
        else {}
    )
    return {
        "precision": "fp8" if ro.fp8_linears else unquantized_precision,
        "kv_cache_dtype": "fp8" if recipe.kv_fp8 else "auto",
        **scales,
        "num_first_layers_in_bf16": ro.bf16_first_layers,
        "quantization_ignored_layer_kws": list(ro.bf16_layer_kws),
        "num_last_layers_in_bf16": ro.bf16_last_layers,
        "use_deep_gemm": ro.use_deep_gemm,
        # NeMo-RL main's MXFP8 rollout switch; v0.7.0 has no such key: written only when true.
        **({"is_mx": True} if ro.fp8_linears and ro.scaling == "mxfp8" else {}),
    }


def nemo_rl_setup_updates(cfg: DictConfig, recipe: Recipe) -> dict[str, Any]:
    """Flat dotted keys NeMo-RL's ``grpo.setup`` asserts for ``recipe`` that ``cfg`` lacks.

    v0.7.0 ``nemo_rl/algorithms/grpo.py`` ~999-1020 (main ~1321-1340): vLLM precision fp8 needs
    ``loss_fn.use_importance_sampling_correction``; an FP8 KV cache needs Megatron pipeline
    parallelism 1 and no async rollouts.
    """
    r = _Reader(cfg)
    out: dict[str, Any] = {}
    if recipe.rollout.fp8_linears and r.get(S.IS_CORRECTION, False) is not True:
        out[S.IS_CORRECTION] = True
    if recipe.kv_fp8:
        if r.get(S.PP_SIZE, 1) != 1:
            out[S.PP_SIZE] = 1
        if r.get(S.VLLM_ASYNC, False) is True:
            out[S.VLLM_ASYNC] = False
    return out


def _kv_source_key(recipe: Recipe) -> str | None:
    """`jetrl.kv_scale_source` for a recipe: null when it is what null means (trainer_calibrated
    with calibration enabled, dynamic without) or when the KV cache is BF16."""
    src = recipe.kv_scale_source
    auto = "trainer_calibrated" if recipe.kv_calibration.enabled else "dynamic"
    return None if src in ("none", auto) else src


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _default_for(path: str) -> Any:
    """What NeMo-RL / nemo_jetrl assume when `path` is absent."""
    if path.startswith("jetrl."):
        return default_of(path)
    return {
        S.FP32_SCALES_KEY: "0",
        S.VLLM_FIRST_BF16: 0,
        S.VLLM_IGNORED_KWS: [],
        S.VLLM_LAST_BF16: 0,
        S.VLLM_DEEP_GEMM: False,
        S.VLLM_IS_MX: False,
        S.VLLM_POW2_W: False,
        S.VLLM_POW2_A: False,
        S.VLLM_KV_DTYPE: "auto",
        S.FP8_ENABLED: False,
        S.FP8_PARAM: False,
    }.get(path, _MISSING)


def minimal_updates(cfg: DictConfig, updates: Mapping[str, Any]) -> dict[str, Any]:
    """The dotted keys of `updates` whose value differs from what `cfg` means today (an absent
    key counts as its default), so that align only writes what changes."""
    r = _Reader(cfg)
    out: dict[str, Any] = {}
    for path, new in _flatten(updates).items():
        cur = r.get(path, _default_for(path)) if r.has(path) else _default_for(path)
        if path == S.FP32_SCALES_KEY:
            cur = None if cur is None else str(cur)
            cur = "0" if cur is None else cur
        if cur is _MISSING or cur != new:
            out[path] = new
    return out


def merge_updates(cfg: DictConfig, updates: Mapping[str, Any]) -> DictConfig:
    """A new config: `cfg` with `updates` (nested, or flat dotted keys) merged in.

    Interpolations elsewhere are kept; a key being set replaces its interpolation."""
    new = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for path, value in _flatten(updates).items():
        parent = path.rpartition(".")[0]
        if parent and OmegaConf.select(new, parent, default=None) is None and _exists(new, parent):
            OmegaConf.update(new, parent, {}, merge=False)  # e.g. env_vars: null
        OmegaConf.update(new, path, value, merge=False, force_add=True)
    return new  # type: ignore[return-value]
