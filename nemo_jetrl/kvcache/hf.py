"""Trainer-side Q/K/V scale calibration of HuggingFace transformers models, and the controller
of one RL run's FP8 KV cache: `calibrate` runs observer forwards through the attention wrapper of
`nemo_jetrl.kvcache.hf_attention` and turns the amax into scales; `KVCacheController` keeps the
scales, attaches the rollout and training models and installs new scales on both at once.
`attach_kv` and `KVHandle` are importable from here too. transformers is imported lazily.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from nemo_jetrl.kvcache.calibration import (
    AmaxObserver,
    CalibrationResult,
    scales_from_amax,
    select_sequences,
    token_mask,
)
from nemo_jetrl.kvcache.hf_attention import _HANDLE_ATTR, KVHandle, attach_kv
from nemo_jetrl.kvcache.quant import Kernel
from nemo_jetrl.kvcache.scales import KVScales
from nemo_jetrl.kvcache.settings import CalibrationSettings, MaskMode

__all__ = ["KVCacheController", "KVHandle", "attach_kv", "calibrate"]


@torch.no_grad()
def _observe(
    model: torch.nn.Module,
    observer: AmaxObserver,
    batch: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    tmask: torch.Tensor | None,
    micro_batch_size: int,
) -> None:
    """Full-sequence forwards over ``batch`` (ids, attention mask, positions) in micro-batches,
    each with its token mask set on the observer."""
    ids, am, pos = batch
    for start in range(0, ids.shape[0], micro_batch_size):
        mb = slice(start, start + micro_batch_size)
        observer.set_mask(None if tmask is None else tmask[mb])
        kwargs: dict[str, Any] = {"input_ids": ids[mb], "use_cache": False}
        if am is not None:
            kwargs["attention_mask"] = am[mb]
        if pos is not None:
            kwargs["position_ids"] = pos[mb]
        model(**kwargs)


def calibrate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    *,
    settings: CalibrationSettings | None = None,
    previous: KVScales | None = None,
    position_ids: torch.Tensor | None = None,
    mask: MaskMode | None = None,
) -> CalibrationResult:
    """Observe post-RoPE Q/K/V amax over a batch and turn them into per-layer FP8 scales.

    ``input_ids``/``attention_mask``/``response_mask`` are ``[batch, tokens]`` (prompt +
    response, padded). The model runs full-sequence forwards in micro-batches of
    ``settings.micro_batch_size`` on ``settings.data_fraction`` of the sequences, under whatever
    FP8 KV mode its handle is in (on-policy KV keeps the rollout's numbers in deeper layers).
    ``mask`` overrides ``settings.mask`` (e.g. "prompt_and_response" before the first rollout).
    Invalid layers are refused with a `KVScaleRefusedWarning` and keep ``previous``.
    """
    settings = settings or CalibrationSettings()
    t0 = time.perf_counter()
    existing = getattr(model, _HANDLE_ATTR, None)
    handle = existing if isinstance(existing, KVHandle) and existing.active else attach_kv(model)
    was_training = model.training
    try:
        idx = select_sequences(input_ids.shape[0], settings.data_fraction)
        sel = lambda t: None if t is None else t[idx.to(t.device)]  # noqa: E731
        ids, am, rm, pos = (
            sel(input_ids),
            sel(attention_mask),
            sel(response_mask),
            sel(position_ids),
        )
        tmask = token_mask(am, rm, mask or settings.mask)
        observer = AmaxObserver(include_q=settings.include_q)
        model.eval()
        with handle.observing(observer):
            _observe(model, observer, (ids, am, pos), tmask, settings.micro_batch_size)
        amax = observer.amax(settings.reduction, settings.percentile)
        scales, refused = scales_from_amax(amax, settings, previous)
    finally:
        model.train(was_training)
        if handle is not existing:
            handle.restore()
    return CalibrationResult(
        scales=scales,
        amax=amax,
        refused=refused,
        micro_batches=observer.micro_batches,
        sequences=int(ids.shape[0]),
        seconds=time.perf_counter() - t0,
    )


class KVCacheController:
    """FP8 KV for one RL run: scales, calibration, and the models they apply to.

    Typical local-backend use::

        ctl = KVCacheController(CalibrationSettings.from_recipe(recipe.kv_calibration))
        ctl.attach(rollout_model, role="rollout")                      # FP8 cache, no grad
        ctl.attach(train_model, role="train", onpolicy=recipe.onpolicy_kv)
        ctl.calibrate(train_model, prompt_ids, prompt_mask, mask="prompt_and_response")  # step 0
        ...
        cache = ctl.rollout_cache()     # pass as past_key_values= to generate()
        ...                             # score, update
        res = ctl.calibrate(train_model, ids, attention_mask, response_mask)   # after the update
        log("timing/train/kv_calibration", res.seconds)

    `calibrate` installs the new scales on every attached model at once, so the next rollout and
    the next trainer forward use the same scales (the refit ships them together with the weights).
    """

    def __init__(
        self,
        settings: CalibrationSettings | None = None,
        *,
        kernel: Kernel = "cuda",
        quantize_q: bool = False,
        scales: KVScales | None = None,
    ) -> None:
        self.settings = settings or CalibrationSettings()
        if quantize_q and not self.settings.include_q:
            raise ValueError("quantize_q=True needs calibration settings with include_q=True")
        self.kernel = kernel
        self.quantize_q = quantize_q
        self.scales = scales
        self.handles: dict[str, KVHandle] = {}
        self.last: CalibrationResult | None = None

    def attach(
        self, model: torch.nn.Module, *, role: str = "rollout", onpolicy: bool = False
    ) -> KVHandle:
        """Attach to a model. ``role="rollout"``: FP8 KV always on (inference, no gradient).

        ``role="train"``: FP8 KV with straight-through gradient when ``onpolicy``; otherwise the
        trainer's attention stays unquantized (observers only; an off-policy KV edge).
        """
        if role not in ("rollout", "train"):
            raise ValueError(f"role={role!r}: use 'rollout' or 'train'")
        quantize = role == "rollout" or onpolicy
        h = attach_kv(
            model,
            scales=self.scales,
            quantize=quantize,
            ste=role == "train" and onpolicy,
            quantize_q=self.quantize_q and quantize,
            kernel=self.kernel,
        )
        self.handles[role] = h
        return h

    def set_scales(self, scales: KVScales | None) -> None:
        """Install scales on every attached model (refit path), all or nothing: scales for a
        layer an attached model lacks are refused (ValueError) before any model changes."""
        if scales is not None:
            for role, h in self.handles.items():
                extra = sorted(set(scales.layers) - set(h.layers))
                if extra:
                    raise ValueError(
                        f"KV scales refused, previous scales kept: layers {extra} do not exist in "
                        f"the {role} model (its attention layers: {h.layers})"
                    )
        self.scales = scales
        for h in self.handles.values():
            h.set_scales(scales)

    def calibrate(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        response_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        mask: MaskMode | None = None,
    ) -> CalibrationResult:
        """Recalibrate on this batch, install the scales everywhere, return the result."""
        res = calibrate(
            model,
            input_ids,
            attention_mask,
            response_mask,
            settings=self.settings,
            previous=self.scales,
            position_ids=position_ids,
            mask=mask,
        )
        self.set_scales(res.scales)
        self.last = res
        return res

    def rollout_cache(self) -> Any:
        """A fresh FP8 KV cache for one `generate` call of the rollout model."""
        if "rollout" not in self.handles:
            raise RuntimeError("attach the rollout model first: ctl.attach(model, role='rollout')")
        return self.handles["rollout"].new_cache()

    def detach(self) -> None:
        """Restore every attached model."""
        for h in self.handles.values():
            h.restore()
        self.handles.clear()
