"""Recipe -> keyword arguments for ``vllm.LLM`` / ``EngineArgs``, merged with the user's own.

What we set and why:

* ``quantization="fp8"`` and ``hf_overrides.quantization_config`` = {quant_method fp8,
  weight_block_size [128, 128], activation_scheme dynamic, modules_to_not_convert = the BF16 set}.
  This makes vLLM build block-FP8 linear layers (FP8 ``weight`` + fp32 ``weight_scale_inv`` per
  128x128 block, activations quantized per token in groups of 128) from a BF16 checkpoint, and
  keep exactly the layers the trainer keeps in BF16. The quantizer and GEMM those layers use come
  from our kernel (``kernel.py``), registered by ``apply_patches``.
* ``load_format="dummy"``: a BF16 checkpoint cannot be loaded into FP8 parameters (vLLM would
  cast values without scales), so the engine starts with placeholder weights and the first refit
  (``refit.refit`` or ``refit.refit_from_checkpoint``) loads the trainer-quantized ones. This is
  how NeMo-RL starts colocated vLLM as well. A user value wins (reported as a note).
* ``worker_extension_cls``: our worker methods (load FP8 weights in place, read them back, set KV
  scales, capture activations), reached through ``LLM.collective_rpc``.
* ``compilation_config.pass_config``: vLLM's compile-time fusion passes that fuse RMSNorm/SiLU
  (and attention output) with *vLLM's* FP8 quantizer are switched off, so no fused kernel can
  quantize activations behind our back. Our quantizer and GEMM are opaque custom ops, so
  torch.compile cannot rewrite them either.
* ``linear_backend`` / ``kernel_config.linear_backend`` /
  ``kernel_config.linear_backend_per_quant.fp8_block_w8a8`` (vLLM >= 0.32): a user value other
  than ``auto`` is a conflict, since vLLM may then filter our kernel out of its list
  (``guard.engine_arg_problems``). We set nothing there (vLLM 0.20 has no such argument).
* ``kv_cache_dtype`` from the recipe. With an FP8 KV cache a user ``calculate_kv_scales=True``
  (a vLLM 0.20 engine argument) is a conflict: vLLM would replace the calibrated scales.

Merging rules (NeMo-RL lost user ``hf_overrides`` three times; we never drop anything):
user keys we do not set pass through untouched; nested dicts (``hf_overrides``,
``compilation_config``) are merged key by key; a user value that contradicts a *required* setting
(anything that would change the numerics) is an error, and all such conflicts are reported
together; a user value that differs from a *default* we chose wins and is reported in ``notes``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nemo_jetrl.vllm_patch import guard
from nemo_jetrl.vllm_patch.settings import WEIGHT_BLOCK, PatchSettings, settings_from_recipe

WORKER_EXTENSION = "nemo_jetrl.vllm_patch.worker_ext.JetRLWorkerExtension"
# Fusion passes that would put vLLM's own FP8 quantizer back into the graph.
FUSION_PASSES_OFF = {"fuse_norm_quant": False, "fuse_act_quant": False, "fuse_attn_quant": False}


class EngineArgsConflict(ValueError):
    """User engine kwargs contradict settings the recipe requires; the message lists all."""


@dataclass(frozen=True)
class EngineKwargs:
    """The merged kwargs for ``vllm.LLM(**kwargs)`` and what the merge decided."""

    kwargs: dict[str, Any]
    """Pass as ``vllm.LLM(model=..., **kwargs)``; includes every user key."""
    notes: tuple[str, ...]
    """User values that replaced one of our defaults (kept, but worth knowing)."""
    settings: PatchSettings
    """The patch settings these kwargs were built for (give the same to ``apply_patches``)."""


def quantization_config(settings: PatchSettings) -> dict[str, Any]:
    """The block-FP8 ``quantization_config`` vLLM's Fp8Config reads."""
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(WEIGHT_BLOCK),
        "modules_to_not_convert": list(settings.modules_to_not_convert),
    }


def _required(settings: PatchSettings) -> dict[str, Any]:
    req: dict[str, Any] = {"worker_extension_cls": WORKER_EXTENSION}
    if settings.fp8_weights:
        req["quantization"] = "fp8"
        req["hf_overrides"] = {"quantization_config": quantization_config(settings)}
    if settings.kv_cache_dtype != "auto":
        req["kv_cache_dtype"] = settings.kv_cache_dtype
    return req


def _defaults(settings: PatchSettings) -> dict[str, Any]:
    dflt: dict[str, Any] = {}
    if settings.fp8_weights:
        dflt["load_format"] = "dummy"
        dflt["compilation_config"] = {"pass_config": dict(FUSION_PASSES_OFF)}
    if settings.kv_cache_dtype == "auto":
        dflt["kv_cache_dtype"] = "auto"
    return dflt


def _merge(
    ours: Mapping[str, Any],
    user: Mapping[str, Any],
    path: str,
    *,
    required: bool,
    conflicts: list[str],
    notes: list[str],
) -> dict[str, Any]:
    out = dict(user)
    for key, val in ours.items():
        where = f"{path}{key}"
        if key not in user:
            out[key] = val
            continue
        uval = user[key]
        if isinstance(val, Mapping) and isinstance(uval, Mapping):
            out[key] = _merge(
                val, uval, where + ".", required=required, conflicts=conflicts, notes=notes
            )
        elif _same(val, uval):
            out[key] = uval
        elif required:
            conflicts.append(f"{where}: you set {uval!r}, the recipe requires {val!r}")
        else:
            notes.append(f"{where}: keeping your {uval!r} (our default was {val!r})")
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


class ComposedHfOverrides:
    """hf_overrides for a user callable: run the user's function, then apply ours (checked)."""

    def __init__(self, user_fn: Callable[[Any], Any], ours: Mapping[str, Any]) -> None:
        self.user_fn = user_fn
        self.ours = dict(ours)

    def __call__(self, hf_config: Any) -> Any:
        hf_config = self.user_fn(hf_config)
        for key, val in self.ours.items():
            current = getattr(hf_config, key, None)
            if current is not None and key == "quantization_config" and current != val:
                merged = dict(current)
                bad = [k for k in val if k in merged and not _same(merged[k], val[k])]
                if bad:
                    raise EngineArgsConflict(
                        f"hf_overrides (your callable) set quantization_config keys {bad} to "
                        f"{[merged[k] for k in bad]}, the recipe requires {[val[k] for k in bad]}"
                    )
                merged.update(val)
                val = merged
            setattr(hf_config, key, val)
        return hf_config


def build_engine_kwargs(
    recipe: Any,
    user_kwargs: Mapping[str, Any] | None = None,
    *,
    num_layers: int | None = None,
) -> EngineKwargs:
    """vLLM engine kwargs for ``recipe`` (a Recipe or PatchSettings) merged with ``user_kwargs``.

    Raises EngineArgsConflict listing every user value that contradicts a required setting.
    """
    settings = settings_from_recipe(recipe, num_layers=num_layers)
    user = dict(user_kwargs or {})
    conflicts: list[str] = []
    notes: list[str] = []
    required = _required(settings)
    user_hf = user.get("hf_overrides")
    composed = None
    if callable(user_hf) and "hf_overrides" in required:
        composed = ComposedHfOverrides(user_hf, required.pop("hf_overrides"))
        user.pop("hf_overrides")
    elif user_hf is not None and not isinstance(user_hf, Mapping):
        conflicts.append(
            f"hf_overrides: expected a dict or a callable, got {type(user_hf).__name__}"
        )
    if settings.fp8_kv_cache and user.get("calculate_kv_scales"):
        # vLLM 0.20 (absent in 0.32): the first forward would replace the calibrated scales.
        conflicts.append(
            "calculate_kv_scales: you set True; vLLM would overwrite the trainer-calibrated KV "
            "scales with its own from the first batch. Remove it (scales come with each refit)"
        )
    if settings.fp8_weights:
        conflicts += guard.engine_arg_problems(user)
    merged = _merge(required, user, "", required=True, conflicts=conflicts, notes=notes)
    merged = _merge(
        _defaults(settings), merged, "", required=False, conflicts=conflicts, notes=notes
    )
    if composed is not None:
        merged["hf_overrides"] = composed
        notes.append(
            "hf_overrides: your callable runs first, then the recipe's quantization_config"
        )
    extra = merged.get("additional_config") or {}
    if not isinstance(extra, Mapping):
        conflicts.append(
            f"additional_config: expected a dict, got {type(extra).__name__} (nemo_jetrl adds "
            "its kernel settings to it: vLLM hashes it into its compile-cache key)"
        )
    elif settings.fp8_weights or settings.fp8_kv_cache:
        merged["additional_config"] = {**extra, **settings_cache_key(settings.to_json())}
    if conflicts:
        raise EngineArgsConflict(
            "vLLM engine kwargs conflict with the recipe (change or remove these keys, or change "
            "the recipe):\n  - " + "\n  - ".join(conflicts)
        )
    return EngineKwargs(kwargs=merged, notes=tuple(notes), settings=settings)


CACHE_KEY = "nemo_jetrl_kernel_settings"


def settings_cache_key(settings_json: str) -> dict[str, str]:
    """Our entry of vLLM's ``additional_config``: the patch settings, which vLLM hashes into the
    key of its torch.compile cache. Our ops take the scale mode and eps as constants of the traced
    graph, so without them a compiled graph of another recipe (pow2 vs FP32 scales) on the same
    model would be loaded from the cache and run its quantizer mode (found by reading vLLM's
    ``VllmConfig.compute_hash`` and compile cache, 2026-12-01)."""
    return {CACHE_KEY: settings_json}
