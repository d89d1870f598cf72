"""The rehearsal's FP8 KV cache (recipe jetrl_kv): what our Megatron policy worker
(`nemo_jetrl.backends.nemo_rl.worker`) does for it on the cluster, done on the CPU policy's model.

* `CpuKV`: our `KVCacheController` attached to the training model as the local backend attaches
  it (on-policy FP8 KV when the recipe asks), so log-probabilities and the train step run with
  the calibrated scales; `CpuKV.calibrate` is ``calibrate_qkv_fp8_scales`` (NeMo-RL's result
  shape) and remembers the vLLM-named scales for the refit.
* `kv_refit_tensors`: what a refit appends after the weights when vLLM's KV cache is FP8, as
  NeMo-RL's Megatron ``_iter_params_with_optional_kv_scales`` does: one float32 ``[1]`` tensor
  per name of ``get_vllm_qkv_scale_names``, valued from the caller's ``kv_scales``, else our last
  calibration (`calibration.refit_kv_scales`), else 1.0.
* `cpu_fp8_kv_refusal`: why vLLM's CPU build here cannot run the config's FP8 KV cache.
* `engine_kv_scales` / `kv_report`: the scales each vLLM attention layer uses after a refit,
  read back and compared with what the refit sent (the per-step line of the rehearsal).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from nemo_jetrl.backends.nemo_rl.calibration import refit_kv_scales

KV_DTYPE_KEY = "policy.generation.vllm_cfg.kv_cache_dtype"


def fp8_kv_cache(generation: Mapping[str, Any]) -> bool:
    """NeMo-RL's test (``policy.generation``): vLLM generation with an fp8* ``kv_cache_dtype``."""
    vllm_cfg = generation.get("vllm_cfg") or {}
    dtype = str(vllm_cfg.get("kv_cache_dtype") or "auto")
    return generation.get("backend", "vllm") == "vllm" and dtype.startswith("fp8")


def scale_names(
    num_layers: int, names_of: Callable[[int], Mapping[str, str]] | None = None
) -> list[str]:
    """The refit's KV scale names, layer by layer (NeMo-RL's ``get_vllm_qkv_scale_names``)."""
    if names_of is None:
        from nemo_rl.models.generation.vllm.quantization.fp8_train_utils import (
            get_vllm_qkv_scale_names as names_of,
        )
    return [name for layer in range(num_layers) for name in names_of(layer).values()]


def kv_refit_tensors(
    names: Sequence[str],
    given: Mapping[str, float] | None,
    calibrated: Mapping[str, float] | None,
) -> list[tuple[str, torch.Tensor]]:
    """``(name, float32 tensor of shape [1])`` per scale name: ``given`` (refused when it
    contradicts ``calibrated``), else ``calibrated``, else 1.0 (vLLM's default, as NeMo-RL)."""
    scales = refit_kv_scales(given, calibrated) or {}
    return [
        (name, torch.tensor(float(scales.get(name, 1.0)), dtype=torch.float32).reshape(1))
        for name in names
    ]


class CpuKV:
    """The training model's FP8 KV: attached at construction, recalibrated on request."""

    def __init__(self, model: torch.nn.Module, recipe: Any) -> None:
        from nemo_jetrl.kvcache import CalibrationSettings, rollout_cache_kernel
        from nemo_jetrl.kvcache.hf import KVCacheController

        self.recipe = recipe
        # the rehearsal's rollout is vLLM's CPU engine: K/V as its cache writer stores them
        self.controller = KVCacheController(
            CalibrationSettings.from_recipe(recipe.kv_calibration),
            kernel=rollout_cache_kernel("vllm", "cpu"),
        )
        self.controller.attach(model, role="train", onpolicy=recipe.onpolicy_kv)
        self.vllm_scales: dict[str, float] | None = None  # the last calibration, vLLM names

    def calibrate(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        input_lengths: torch.Tensor,
        *,
        micro_batch_size: int,
        include_q: bool,
    ) -> dict[str, Any]:
        """Our calibration on ``input_ids`` (right-padded; real tokens from ``input_lengths``),
        installed on the training model; NeMo-RL's result shape plus our ``jetrl`` details."""
        from nemo_jetrl.kvcache import CalibrationSettings
        from nemo_jetrl.kvcache.hf import calibrate

        cal = self.recipe.kv_calibration
        # NeMo-RL's include_q=True request is never dropped (as the Megatron worker)
        settings = CalibrationSettings.from_recipe(
            cal,
            include_q=bool(include_q) or cal.include_q is True,
            micro_batch_size=int(cal.micro_batch_size or micro_batch_size),
        )
        # NeMo-RL's data carries no response mask (translate refuses mask=response): every real
        # token counts, or every token with mask=none (padding too, NeMo-RL's own behaviour)
        by_lengths = settings.mask != "none"
        positions = torch.arange(input_ids.shape[1])[None, :]
        real = (positions < input_lengths.reshape(-1, 1).to(torch.long)).to(torch.long)
        res = calibrate(
            model,
            input_ids,
            real if by_lengths else None,
            settings=settings,
            previous=self.controller.scales,
            mask="prompt_and_response" if by_lengths else "none",
        )
        self.controller.set_scales(res.scales)
        self.controller.last = res
        out = res.to_nemo_rl(settings)
        self.vllm_scales = dict(out["layers"])
        out["jetrl"] = res.report()
        return out


def cpu_fp8_kv_refusal(
    vllm_cfg: Mapping[str, Any], recipe: str, head_size: int, version: str | None = None
) -> str | None:
    """Why this machine's vLLM CPU build cannot run the FP8 KV cache ``vllm_cfg`` asks for, with
    what to do; None when it can (or the cache is not FP8). ``version``: vLLM's (None: this
    Python's vLLM, imported: the rehearsal's driver Python is its vLLM workers' Python)."""
    dtype = str(vllm_cfg.get("kv_cache_dtype") or "auto")
    if not dtype.startswith("fp8"):
        return None
    from nemo_jetrl.vllm_patch.compat import cpu_fp8_kv_cache

    ok, why = cpu_fp8_kv_cache(head_size=head_size, version=version)
    if ok:
        return None
    return (
        f"recipe {recipe!r} runs vLLM with an FP8 KV cache ({KV_DTYPE_KEY}={dtype!r}), which "
        f"vLLM's CPU build cannot run on this machine: {why}. It rehearses with vLLM >= 0.25 "
        "on an x86 CPU with AVX-512 or AMX (NeMo-RL main's tier: bash "
        "scripts/setup_nemo_rl_env.sh main-7ea279a); here, rehearse the jetrl recipe (the same "
        "FP8 linears, BF16 KV cache)"
    )


def engine_kv_scales(worker: Any) -> dict[str, dict[str, float]]:
    """In a vLLM worker: each attention layer's q/k/v scales as its kernels receive them."""
    from nemo_jetrl.vllm_patch import compat

    model = worker.model_runner.model
    return {
        name: compat.read_attention_kv_scales(m)
        for name, m in model.named_modules()
        if compat.is_attention_layer(m)
    }


def kv_report(
    sent: Mapping[str, float],
    calibrated: Mapping[str, float] | None,
    engines: Sequence[Mapping[str, Mapping[str, float]]],
) -> tuple[str, list[str]]:
    """(the step's KV line, differences): the scales a refit ``sent`` (NeMo-RL names) against
    what each engine's attention layers use (host float and device tensor both)."""
    from nemo_jetrl.backends.nemo_rl.refit_batches import KV_NAME

    differ: list[str] = []
    layers: dict[str, set[str]] = {}
    for name, want in sorted(sent.items()):
        m = KV_NAME.match(name)
        if m is None:
            differ.append(f"{name}: not a KV scale name")
            continue
        layer, t = f"{m['layer']}.attn", m["t"]
        if calibrated is not None and name in calibrated:
            layers.setdefault(layer, set()).add(t)
        w32 = float(torch.tensor(float(want), dtype=torch.float32))
        for rank, engine in enumerate(engines):
            got = engine.get(layer, {})
            seen = (got.get(t), got.get(f"{t}_tensor"))
            if seen != (w32, w32):
                differ.append(f"{name}: sent {w32!r}, vLLM worker {rank} uses {seen!r}")
    kinds = sorted({t for ts in layers.values() for t in ts}, key="qkv".index)
    what = f"{len(layers)} layers calibrated ({','.join(kinds) or '-'})"
    if not sent:
        return "KV scales: none sent (policy.generation.vllm_cfg.kv_cache_dtype is not fp8)", differ
    if differ:
        return f"KV scales: {what}, DIFFERENT in the engine", differ
    return f"KV scales: {what}, identical in the engine", differ
