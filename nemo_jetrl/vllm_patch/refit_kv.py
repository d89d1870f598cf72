"""Refit, KV-scale half: validate q/k/v scales, check them against the engine, send them.

`nemo_jetrl.vllm_patch.refit.refit` calls these before any weight is sent (so invalid or stale
scales refuse the whole refit) and `set_kv_scales` after the weights are in; `set_kv_scales` is
also the scales-only path. After either, `drop_cached_prefixes` empties vLLM's prefix cache. The rule for one scale value and one layer index is
`nemo_jetrl.kvcache.scales` (`scale_problem`, `layer_problem`), the same rule `KVScales` applies.
The refit errors live here (re-exported by `refit`) so that both halves raise the same classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nemo_jetrl.kvcache.scales import layer_problem, scale_problem


class RefitError(ValueError):
    """A refit input was refused (non-finite, wrong shape/dims, bad KV scale); nothing loaded."""


class ParityError(RuntimeError):
    """The engine's FP8 weights or scales differ from the trainer's quantization."""


def normalize_kv_scales(
    kv_scales: Mapping[Any, Mapping[str, float]], prefix: str = "model.layers"
) -> dict[str, dict[str, float]]:
    """{layer index or attention module name: {q, k, v}} -> {attention module name: ...}.

    Validates every entry (finite, > 0, all of q/k/v present) and reports all problems at once.
    """
    out: dict[str, dict[str, float]] = {}
    errors = []
    for key, s in kv_scales.items():
        if not isinstance(key, str) and (why := layer_problem(key)) is not None:
            errors.append(f"KV scales {why}")
            continue
        name = f"{prefix}.{key}.self_attn.attn" if isinstance(key, int) else str(key)
        entry = {}
        for k in ("q", "k", "v"):
            v = s.get(k) if isinstance(s, Mapping) else None
            if (why := scale_problem(v)) is not None:
                errors.append(f"{name}.{k}_scale={v!r}: {why}")
            else:
                entry[k] = float(v)  # type: ignore[arg-type]
        out[name] = entry
    if errors:
        raise RefitError("KV scales refused, previous scales kept:\n  - " + "\n  - ".join(errors))
    return out


def check_kv_layers(llm: Any, scales: Mapping[str, Any]) -> None:
    """Refuse scales for attention layers the engine does not have (nothing is changed)."""
    known = llm.collective_rpc("jetrl_kv_scales")[0]
    unknown = sorted(set(scales) - set(known))
    if unknown:
        raise RefitError(
            f"KV scales refused, previous weights and scales kept: unknown attention layers "
            f"{unknown} (the engine has {sorted(known)})"
        )


def set_kv_scales(llm: Any, kv_scales: Mapping[Any, Mapping[str, float]]) -> tuple[str, ...]:
    """Send validated q/k/v scales to every worker (all-or-nothing per worker)."""
    scales = normalize_kv_scales(kv_scales)
    check_kv_layers(llm, scales)
    results = llm.collective_rpc("jetrl_set_kv_scales", args=(scales,))
    # Read back what the attention layers now hold (host floats and device tensors, in fp32).
    back = llm.collective_rpc("jetrl_kv_scales")[0]
    wrong = [
        f"{name}.{k}_scale: sent {s[k]!r}, layer holds {back[name][k]!r} / {back[name][k + '_tensor']!r}"
        for name, s in scales.items()
        for k in ("q", "k", "v")
        if not (
            back[name][k] == s[k]
            and back[name][f"{k}_tensor"] == float(torch.tensor(s[k], dtype=torch.float32))
        )
    ]
    if wrong:
        raise ParityError(
            "KV scales did not reach the attention layers:\n  - " + "\n  - ".join(wrong)
        )
    drop_cached_prefixes(llm)  # cached FP8 KV was quantized with the old scales
    return tuple(results[0])


def drop_cached_prefixes(llm: Any) -> None:
    """Empty ``llm``'s prefix cache: KV blocks computed under the weights (or KV scales) a refit
    just replaced must not serve a later prompt with the same prefix, or the rollout would run
    on the old policy for that prefix while parity says the new one is in. NeMo-RL does the same
    after its own refits (``invalidate_kv_cache``). vLLM refuses while requests still hold KV
    blocks; that is an error here (a refit must not run under live requests)."""
    if not llm.reset_prefix_cache():
        raise RefitError(
            "vLLM's prefix cache could not be reset after the refit (requests are still "
            "running): KV computed under the old weights could be reused; refit between "
            "generate calls"
        )


def kv_scales(llm: Any) -> dict[str, dict[str, float]]:
    """The q/k/v scales each attention layer of the first worker uses now."""
    return llm.collective_rpc("jetrl_kv_scales")[0]


def fresh_kv_layers(kv_scales: Any, weights_version: int | None) -> Mapping[Any, Any]:
    """The per-layer mapping of ``kv_scales``; RefitError when they are stale (calibrated on
    other weights than the ones this refit sends)."""
    layers = getattr(kv_scales, "layers", None)
    if layers is None:
        return kv_scales
    made_for = getattr(kv_scales, "calibrated_for", None)
    if made_for is not None and weights_version is not None and made_for != weights_version:
        raise RefitError(
            f"KV scales refused as stale, nothing was loaded: calibrated for weights version "
            f"{made_for}, this refit sends version {weights_version}; recalibrate on the new "
            "weights (or send the scales with the refit they were calibrated for)"
        )
    return layers
