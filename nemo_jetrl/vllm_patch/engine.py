"""A patched vLLM rollout engine in one object: patch, engine kwargs, first load, refit, sample.

This is what a backend (the local CPU backend's ``rollout.engine: vllm``, or a NeMo-RL worker)
needs from vLLM for one RL step: sample responses with per-token logprobs, then take the
trainer's new weights. ``close()`` shuts the engine down and reverts the patch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_jetrl._optional import require
from nemo_jetrl.vllm_patch import compat
from nemo_jetrl.vllm_patch.engine_args import EngineKwargs, build_engine_kwargs
from nemo_jetrl.vllm_patch.guard import KernelNotInEffect, verify_engine_kernels
from nemo_jetrl.vllm_patch.moe_names import router_modules
from nemo_jetrl.vllm_patch.patch import PatchHandle, apply_patches
from nemo_jetrl.vllm_patch.refit import RefitReport, refit, refit_from_checkpoint
from nemo_jetrl.vllm_patch.settings import PatchSettings
from nemo_jetrl.vllm_patch.shutdown import shutdown_engine, undo_failed_start


@dataclass(frozen=True)
class Generation:
    """One sampled response."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    """Generated token ids (the response)."""
    logprobs: tuple[float, ...]
    """Log-probability of each generated token under the rollout policy (NeMo-RL's
    ``generation_logprobs``)."""
    text: str
    finish_reason: str | None
    request_id: str = ""
    """vLLM's id of the request (``routing_capture.for_request`` finds its routing by it)."""


class KvCacheDtypeMismatch(RuntimeError):
    """The engine runs a different KV cache dtype than the recipe asked for."""


def check_engine_kv_cache_dtype(llm: Any, settings: PatchSettings) -> None:
    """Refuse an engine that silently dropped the recipe's FP8 KV cache.

    vLLM 0.20's CPU platform replaces ``kv_cache_dtype=fp8`` with the model dtype (a warning in
    its log only). The trainer then models an FP8 KV cache the rollout does not have: off-policy.
    """
    if not settings.fp8_kv_cache:
        return
    used = compat.engine_kv_cache_dtype(llm)
    if not used.startswith("fp8"):
        raise KvCacheDtypeMismatch(
            f"the recipe asks for kv_cache_dtype={settings.kv_cache_dtype!r} but this vLLM "
            f"engine runs kv_cache_dtype={used!r} (vLLM replaced it on this platform, e.g. vLLM "
            "0.20's CPU backend has no FP8 KV cache). Use a recipe without FP8 KV cache "
            "(jetrl instead of jetrl_kv) here, or run on a GPU"
        )


def _num_layers(model_dir: str | Path) -> int | None:
    cfg = Path(model_dir) / "config.json"
    if not cfg.is_file():
        return None
    return json.loads(cfg.read_text()).get("num_hidden_layers")


def mla_cpu_backend(model_dir: str | Path, user: Mapping[str, Any]) -> dict[str, str]:
    """``{"attention_backend": "CPU_MLA"}`` for an MLA model (config.json ``kv_lora_rank``) on
    vLLM's CPU build when it has that backend and the user chose none: on AMX CPUs vLLM 0.32
    would pick ``AMX_MLA``, which requantizes kv_b_proj per tensor and empties its weight
    (docs/vllm_patch.md, "MLA"); CPU_MLA serves the recipe's blocks on every CPU."""
    cfg = Path(model_dir) / "config.json"
    if "attention_backend" in user or "attention_config" in user or not cfg.is_file():
        return {}
    if json.loads(cfg.read_text()).get("kv_lora_rank") is None:
        return {}
    from vllm.platforms import current_platform

    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:  # older vLLM: no CPU MLA at all
        return {}
    if not current_platform.is_cpu() or "CPU_MLA" not in AttentionBackendEnum.__members__:
        return {}
    return {"attention_backend": "CPU_MLA"}


class VllmRolloutEngine:
    """``vllm.LLM`` started under the patch for ``recipe``, checked to run our kernel on every
    block-FP8 linear (``guard.verify_engine_kernels``), and loaded by a first refit."""

    def __init__(
        self,
        model_dir: str | Path,
        recipe: Any,
        *,
        engine_kwargs: Mapping[str, Any] | None = None,
        num_layers: int | None = None,
        initial_refit: bool = True,
    ) -> None:
        vllm = require("vllm", feature="the vLLM rollout engine")
        self.model_dir = str(model_dir)
        self.recipe = recipe
        n = num_layers if num_layers is not None else _num_layers(model_dir)
        engine_kwargs = {**(engine_kwargs or {}), **mla_cpu_backend(model_dir, engine_kwargs or {})}
        self.engine_kwargs: EngineKwargs = build_engine_kwargs(recipe, engine_kwargs, num_layers=n)
        routers = [
            r
            for r in router_modules(model_dir)
            if r not in self.engine_kwargs.settings.modules_to_not_convert
        ]
        if routers and self.engine_kwargs.settings.fp8_weights:  # MoE routers stay BF16
            base = self.engine_kwargs.settings
            keep = (*base.modules_to_not_convert, *routers)
            settings = dataclasses.replace(base, modules_to_not_convert=keep)
            self.engine_kwargs = build_engine_kwargs(settings, engine_kwargs)
        self.settings = self.engine_kwargs.settings
        self.patch: PatchHandle | None = apply_patches(self.settings)
        try:
            with undo_failed_start():  # a retry in this process starts from where this did
                self.llm = vllm.LLM(model=self.model_dir, **self.engine_kwargs.kwargs)
            try:
                self.kernel_report = verify_engine_kernels(self.llm, self.settings)
                check_engine_kv_cache_dtype(self.llm, self.settings)
                self.last_refit: RefitReport | None = (
                    refit_from_checkpoint(self.llm, self.model_dir, self.settings)
                    if initial_refit
                    else None
                )
            except KernelNotInEffect:
                raise  # the guard shut the engine down
            except BaseException:
                shutdown_engine(self.llm)  # nobody could close a half-built engine
                raise
        except BaseException:
            self.patch.revert()
            raise

    def refit(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        kv_scales: Mapping[Any, Mapping[str, float]] | None = None,
        parity: bool = True,
        rollback: bool = True,
        weights_version: int | None = None,
    ) -> RefitReport:
        """Load the trainer's weights (HF names) and optional KV scales; see ``refit.refit``
        (``weights_version``: KV scales calibrated for another version are refused as stale;
        ``rollback``: a failure inside the engine restores its previous state)."""
        self.last_refit = refit(
            self.llm,
            state_dict,
            self.settings,
            kv_scales=kv_scales,
            parity=parity,
            rollback=rollback,
            weights_version=weights_version,
        )
        return self.last_refit

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | Sequence[int] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
    ) -> list[Generation]:
        """Sample one response per prompt, with the logprob of every generated token.

        ``seed``: one seed for every prompt, or one per prompt (so that repeated prompts, e.g. the
        samples of one GRPO group, draw different responses reproducibly). Logprobs repeat bit for
        bit only where vLLM runs the same batches: its engine core may step before every prompt of
        a call has arrived, and its BF16 GEMMs (lm_head) are not batch invariant.
        """
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        seeds = list(seed) if isinstance(seed, Sequence) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        sp = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=s,
                logprobs=0,  # the sampled token's own logprob
                stop_token_ids=list(stop_token_ids or []),
                ignore_eos=ignore_eos,
            )
            for s in seeds
        ]
        outs = self.llm.generate(prompts, sp, use_tqdm=False)
        result = []
        for o in outs:
            c = o.outputs[0]
            lps = tuple(
                float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs, strict=True)
            )
            result.append(
                Generation(
                    tuple(o.prompt_token_ids),
                    tuple(c.token_ids),
                    lps,
                    c.text,
                    c.finish_reason,
                    str(o.request_id),
                )
            )
        return result

    def close(self) -> None:
        """Shut the engine down and revert the patch (idempotent)."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            shutdown_engine(llm)
            self.llm = None
        if self.patch is not None:
            self.patch.revert()
            self.patch = None

    def __enter__(self) -> VllmRolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
