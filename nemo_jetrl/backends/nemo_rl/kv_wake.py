"""The refit's FP8 KV scales, kept through vLLM's KV-cache wake-up.

NeMo-RL runs a colocated vLLM in sleep mode: before each rollout it wakes the weights, refits
them (our hook loads and checks the trainer's KV scales with them), then wakes the KV cache
(``prepare_for_generation(tags=["kv_cache"])``). On that wake-up vLLM's GPU model runner calls
``init_fp8_kv_scales``, which zeroes the cache and, with an FP8 cache, sets every attention
layer's ``_k_scale``/``k_scale``/``_v_scale``/``v_scale`` to 1.0 (vLLM 0.20, 0.25, 0.32: its
"restore calibrated scales" is a TODO). The rollout would then quantize K/V with 1.0 while the
trainer's on-policy KV uses the calibrated scales, after a parity check that had passed (found by
reading vLLM's ``gpu_worker.wake_up`` and NeMo-RL's ``grpo.refit_policy_generation``,
2026-12-01; vLLM's CPU platform has no sleep mode, so no CPU run reaches it).

So each successful refit keeps its scales on the model runner (`keep_kv_scales`), and the hook
wraps ``GPUModelRunner.init_fp8_kv_scales`` (`wake_wrapper`): after vLLM's reset it writes the
kept scales back into every copy vLLM reads (the loaded parameter, the device tensor, the host
float) and reads them back (`restore_kv_scales`), raising if one did not land.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

KEPT = "_jetrl_kv_scales"
"""The model runner's attribute holding ``{attention module name: {"q"|"k"|"v": scale}}``."""


def keep_kv_scales(runner: Any, kv: Mapping[str, Mapping[str, float]]) -> None:
    """Record the KV scales a refit loaded (merged into those kept from earlier refits)."""
    kept = {layer: dict(per) for layer, per in (getattr(runner, KEPT, None) or {}).items()}
    for layer, per in kv.items():
        kept.setdefault(layer, {}).update({t: float(v) for t, v in per.items()})
    setattr(runner, KEPT, kept)


@torch.no_grad()
def restore_kv_scales(runner: Any) -> int:
    """Write the kept scales back into every attention layer; returns how many were written.
    Raises RuntimeError naming a scale that does not read back."""
    from nemo_jetrl.vllm_patch import compat

    kept = getattr(runner, KEPT, None) or {}
    written = 0
    for layer, per in kept.items():
        module = runner.model.get_submodule(layer)
        for t, v in per.items():
            param = getattr(module, f"{t}_scale", None)
            if isinstance(param, torch.Tensor):
                param.fill_(v)
        used = compat.read_attention_kv_scales(module)
        compat.set_attention_kv_scales(module, {**{t: used[t] for t in compat.KV_KEYS}, **per})
        back = compat.read_attention_kv_scales(module)
        wrong = [
            t for t, v in per.items()
            if back[t] != v or back[f"{t}_tensor"] != float(torch.tensor(v, dtype=torch.float32))
        ]  # fmt: skip
        if wrong:
            raise RuntimeError(
                f"{layer}: the refit's KV scales {wrong} did not read back after vLLM's KV-cache "
                f"wake-up (kept {per}, attention holds {back}): the rollout's FP8 KV would not "
                "use the trainer's scales"
            )
        written += len(per)
    return written


def wake_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GPUModelRunner.init_fp8_kv_scales`` that puts the kept scales back after vLLM's reset."""

    @functools.wraps(original)
    def init_fp8_kv_scales(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        restore_kv_scales(self)
        return out

    return init_fp8_kv_scales


def gpu_model_runner_class() -> type | None:
    """vLLM's GPU model runner class when it has ``init_fp8_kv_scales`` (else None: nothing
    resets the scales there)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return None
    return GPUModelRunner if "init_fp8_kv_scales" in GPUModelRunner.__dict__ else None
