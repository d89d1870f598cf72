"""Our Megatron policy worker for NeMo-RL: the stock worker plus the recipe's training-side duties.

NeMo-RL (v0.7.0) builds its Megatron policy workers from a class name it gives Ray
(``Policy(worker_extension_cls_fqn=...)``); ``@ray.remote`` classes cannot be subclassed, so the
stock worker splits its implementation into ``MegatronPolicyWorkerImpl`` and we subclass that and
decorate it the same way (same runtime_env helper). What the subclass adds:

1. at construction: reads the recipe from ``NEMO_JETRL_RECIPE`` and checks
   ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` against it (both put into the worker's ``runtime_env``
   by ``policy.megatron_cfg.env_vars``, so set before the process started), then
   `ensure_te_scale_env`, which fails if TE's recipe module, already loaded by then (NeMo-RL's
   worker module imports megatron-core, which imports TE), read the other scale rule;
2. after the model is built: stops one whose training forward is not the rollout's (other BF16
   first/last layers, `megatron.config.built_bf16_edges_problem`; TE blocks off the rollout's,
   `megatron.blocks`), or only warns where the run was launched with ``jetrl.allow_off_policy``
   (``NEMO_JETRL_ALLOW_OFF_POLICY``, as `jetrl check`'s gate lets such a run start); our hooks on every ``core_attention`` (on-policy KV when the recipe
   asks for it, with the scales of the last calibration), and the per-name BF16 linears
   (``jetrl.train_bf16_layer_kws``) wrapped to run outside TE's FP8 (`megatron.bf16_names`);
3. ``calibrate_qkv_fp8_scales`` (what grpo.py calls before each refit when the KV cache is FP8):
   our calibration, one forward per micro-batch through the stock ``get_logprobs``, padding masked
   from ``input_lengths``, invalid layers refused (previous scales kept), max across ranks; returns
   NeMo-RL's result shape so the refit ships the scales to vLLM. Under sequence packing or
   dynamic batching each micro-batch keeps the driver's plan (`calibration.py`);
4. ``_iter_params_with_optional_kv_scales`` (the iterator every refit path streams): our last
   calibrated KV scales whenever the caller passed none (v0.7.0's colocated refit does), so
   vLLM never runs with 1.0 while the trainer uses calibrated scales;
5. ``use_reference_model`` (NeMo-RL swaps the reference policy's weights into this model for
   the KL term's logprobs): the KV stays BF16 meanwhile, as the local backend's reference runs
   (on-policy KV serves the rollout's policy, which never samples from the reference).

The class is created on first access (module ``__getattr__``), so importing this module without
NeMo-RL is harmless; Ray resolves ``nemo_jetrl.backends.nemo_rl.worker.JetrlMegatronPolicyWorker``
through that.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

from nemo_jetrl._optional import require
from nemo_jetrl.recipe_parts import KV_MARGIN, KV_PERCENTILE

CLASS_NAME = "JetrlMegatronPolicyWorker"


def _pipeline_stages(cfg: Any) -> int:
    """NeMo-RL's ``policy.megatron_cfg.pipeline_model_parallel_size`` (1 when unset)."""
    return int((cfg.get("megatron_cfg") or {}).get("pipeline_model_parallel_size") or 1)


def _layer_offset(model: Any) -> int:
    """First global decoder layer of this pipeline stage (Megatron's layer_number is 1-based)."""
    for _, mod in model.named_modules():
        n = getattr(mod, "layer_number", None)
        if isinstance(n, int):
            return n - 1
    return 0


def _all_ranks(obj: Any) -> list[Any]:
    """Every policy rank's ``obj`` (all-gather over the world; ``[obj]`` outside one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _merge_max(amax: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """Elementwise max of per-rank amax over every rank (NeMo-RL's conservative merge; a NaN on
    any rank stays NaN, `calibration.merge_rank_amax`)."""
    from nemo_jetrl.backends.nemo_rl.calibration import merge_rank_amax

    return merge_rank_amax(_all_ranks(amax))


@functools.lru_cache(maxsize=1)
def make_worker_class() -> type:
    """Build the Ray actor class (needs NeMo-RL and Ray)."""
    mpw = require(
        "nemo_rl.models.policy.workers.megatron_policy_worker",
        feature="the NeMo-RL backend's policy worker",
    )
    ray = require("ray", feature="the NeMo-RL backend's policy worker")
    from nemo_jetrl.backends.nemo_rl.calibration import (
        calibration_micro_batches,
        refit_kv_scales,
    )
    from nemo_jetrl.backends.nemo_rl.policy_env import (
        check_policy_env,
        hf_in_proj_split,
        off_policy_allowed,
    )
    from nemo_jetrl.build_info import driver_code_problem
    from nemo_jetrl.kvcache import CalibrationSettings, KVScales
    from nemo_jetrl.megatron.attention import attach_megatron_kv, calibrate_megatron
    from nemo_jetrl.megatron.bf16_names import keep_bf16_by_name, refuse_with_ranks
    from nemo_jetrl.megatron.blocks import block_layout_problem, with_hf_split
    from nemo_jetrl.megatron.config import built_bf16_edges_problem, ensure_te_scale_env

    get_model_config = require("megatron.core.utils", feature="the policy worker").get_model_config

    class _Impl(mpw.MegatronPolicyWorkerImpl):  # type: ignore[name-defined,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            problem = driver_code_problem("NeMo-RL's Megatron policy worker")
            if problem:
                raise RuntimeError(problem)
            recipe = check_policy_env(os.environ)
            split = hf_in_proj_split(os.environ)  # before the model is built: a bad value stops
            if recipe.train.fp8_linears and recipe.train.scaling == "blockwise":
                ensure_te_scale_env(recipe.train.pow2_weight_scales)
            self._jetrl_recipe = recipe
            self._jetrl_scales: KVScales | None = None
            self._jetrl_vllm_scales: dict[str, float] | None = None
            super().__init__(*args, **kwargs)
            config = get_model_config(self.model)
            why = built_bf16_edges_problem(config, recipe.train)
            if not why and recipe.rollout.fp8_linears:  # the real config, TP sizes included
                why = block_layout_problem(with_hf_split(config, split), recipe.train)
            if why and off_policy_allowed(os.environ):  # the user accepted an off-policy run
                print(f"nemo_jetrl: warning: running OFF-POLICY (jetrl.allow_off_policy): {why}",
                      file=sys.stderr, flush=True)  # fmt: skip
            elif why:
                raise RuntimeError(
                    f"nemo_jetrl: {why}. To run it off-policy anyway: jetrl.allow_off_policy=true "
                    "(+jetrl.allow_off_policy=true on the command line of a config with no jetrl:)"
                )
            try:
                self._jetrl_kv = attach_megatron_kv(
                    self.model,
                    onpolicy=recipe.onpolicy_kv,
                    layer_offset=_layer_offset(self.model),
                    allow_empty=_pipeline_stages(self.cfg) > 1,  # a stage of linear attention
                )
            except Exception as exc:  # the other ranks wait in keep_bf16_by_name's gather
                refuse_with_ranks(f"{type(exc).__name__}: {exc}", _all_ranks)
            # Per-name BF16 linears (jetrl.train_bf16_layer_kws) run outside TE's FP8.
            # judged over every pipeline stage: a stage may lack what a word names
            self._jetrl_bf16 = keep_bf16_by_name(
                self.model,
                recipe.train.bf16_layer_kws,
                layer_offset=_layer_offset(self.model),
                gather=_all_ranks,
            )

        def calibrate_qkv_fp8_scales(
            self,
            *,
            data: Any,
            micro_batch_size: int | None = None,
            percentile: float = KV_PERCENTILE,
            margin: float = KV_MARGIN,
            include_q: bool = False,
        ) -> dict[str, Any]:
            import torch

            recipe = self._jetrl_recipe
            cal = recipe.kv_calibration
            # jetrl.kv_calibration.include_q=true adds q_scale; NeMo-RL's request is never dropped.
            settings = CalibrationSettings.from_recipe(
                cal, include_q=bool(include_q) or cal.include_q is True
            )
            mbs = cal.micro_batch_size or micro_batch_size or self.cfg["logprob_batch_size"]
            # Packed sequences carry no padding between sequences; under dynamic batching the
            # micro-batch is truncated to its planned length: in both cases every token is
            # observed (NeMo-RL's own behaviour), which the docs state.
            packed = bool(self.cfg.get("sequence_packing", {}).get("enabled", False))
            dynamic = bool(self.cfg.get("dynamic_batching", {}).get("enabled", False))
            by_lengths = settings.mask != "none" and not packed and not dynamic

            def run(part: Any, size: int) -> Any:
                return self.get_logprobs(
                    data=part, micro_batch_size=size, require_router_replay=False
                )

            def batches():
                # Each micro-batch keeps the driver's packing/dynamic plan (calibration.py).
                for part, size in calibration_micro_batches(
                    data, mbs, packed=packed, dynamic=dynamic
                ):
                    lengths = part["input_lengths"].reshape(-1).to(torch.long).cpu()
                    yield functools.partial(run, part, size), (lengths if by_lengths else None)

            self.model.eval()
            res = calibrate_megatron(
                self.model,
                batches(),
                settings=settings,
                previous=self._jetrl_scales,
                layer_offset=_layer_offset(self.model),
                reduce_amax=_merge_max,
            )
            self._jetrl_scales = res.scales
            self._jetrl_kv.set_scales(res.scales)
            out = res.to_nemo_rl(settings)
            self._jetrl_vllm_scales = dict(out["layers"])
            out["jetrl"] = res.report()
            return out

        @contextlib.contextmanager
        def use_reference_model(self) -> Iterator[None]:
            # NeMo-RL swaps the reference's weights into this same model: without this its
            # logprobs would get on-policy KV with the policy's scales
            with self._jetrl_kv.bf16(), super().use_reference_model():
                yield

        def _iter_params_with_optional_kv_scales(
            self, kv_scales: dict[str, float] | None = None, **kwargs: Any
        ) -> Any:
            # Every refit path of both trees streams through this iterator; v0.7.0's colocated
            # refit passes no kv_scales (vLLM would get 1.0): ship our calibration instead.
            scales = refit_kv_scales(kv_scales, self._jetrl_vllm_scales)
            yield from super()._iter_params_with_optional_kv_scales(kv_scales=scales, **kwargs)

    worker_cls = ray.remote(
        runtime_env=mpw.get_runtime_env_for_policy_worker("megatron_policy_worker")
    )(type(CLASS_NAME, (_Impl,), {"__module__": __name__, "__qualname__": CLASS_NAME}))
    return worker_cls


def __getattr__(name: str) -> Any:
    if name == CLASS_NAME:
        return make_worker_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
