"""Rollout: incremental generation with a KV cache, temperature sampling, per-token logprobs.

This is the local stand-in for vLLM: the rollout model (with `Fp8InferenceLinear` layers under
an FP8 rollout recipe) runs one forward over the prompts, then one token at a time, reusing the
transformers KV cache (an FP8 one under ``jetrl_kv``). For each sampled token it records
``generation_logprobs``: log softmax of ``logits / temperature`` at the sampled id, in fp32, the
same quantity the trainer computes from its full-sequence forward (``prev_logprobs``). Rows that
emitted ``<eos>`` keep generating ``<pad>`` (masked out) until every row finished or
``max_new_tokens`` is reached. Sampling draws from an explicit ``torch.Generator`` so a run is
reproducible and resumable.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nemo_jetrl.invariant import is_batch_invariant, ops


@dataclass
class RolloutBatch:
    """Sampled responses of one batch."""

    response_ids: torch.Tensor
    """[B, R] sampled ids; ``<pad>`` after a row's ``<eos>``."""
    generation_logprobs: torch.Tensor
    """[B, R] fp32 logprob of each sampled token under the rollout policy (0 after ``<eos>``)."""
    response_mask: torch.Tensor
    """[B, R] bool: generated tokens up to and including the first ``<eos>``."""
    finished: torch.Tensor
    """[B] bool: the row produced ``<eos>``."""


def token_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, *, invariant: bool = False
) -> torch.Tensor:
    """fp32 ``log_softmax(logits / T)`` gathered at ``ids`` (shared by rollout and trainer);
    ``invariant``: the batch-invariant `nemo_jetrl.invariant.ops.log_softmax` (same bits for a
    row whether it comes from a decode step or a full-sequence forward)."""
    scaled = logits.float() / temperature
    if invariant:  # the same bits as gathering from ops.log_softmax, less memory on a GPU
        return ops.token_log_softmax(scaled, ids)
    lp = torch.log_softmax(scaled, dim=-1)
    return lp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


SEED_HIGH = 2**63 - 1
"""Exclusive bound of the per-call seed `device_draw` takes from the host generator."""


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One id per row drawn from ``probs`` [B, V], returned on ``probs``' device.

    A CPU run draws with the run's sampling generator itself. On an accelerator the draw runs
    there (`device_draw`), from a generator seeded per call with one draw of the host
    generator: the host's work does not grow with the vocabulary (``torch.multinomial`` with a
    CPU generator draws one exponential per entry: 131 ms for 32 rows of Qwen3's 151,936 on a
    2-core EPYC, every decode step), and a run is still reproducible and resumable from the
    checkpointed host state; its draws are the device's own, not the CPU run's."""
    if generator is not None and generator.device != probs.device:
        # a fresh device generator each call: no state shared between runs or threads
        return device_draw(probs, generator, torch.Generator(device=probs.device))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def device_draw(
    probs: torch.Tensor, host: torch.Generator, device_generator: torch.Generator
) -> torch.Tensor:
    """``torch.multinomial(probs, 1)`` with ``device_generator`` (on ``probs``' device) seeded
    by one draw of ``host``: the host generator advances by that one draw whatever ``probs``'
    shape."""
    seed = int(torch.randint(SEED_HIGH, (1,), generator=host))
    device_generator.manual_seed(seed)
    return torch.multinomial(probs, 1, generator=device_generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    eos_id: int,
    pad_id: int,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    cache_factory: Callable[[], Any] | None = None,
) -> RolloutBatch:
    """Sample up to ``max_new_tokens`` per row (see the module docstring)."""
    tf = __import__("transformers")
    bsz = prompt_ids.shape[0]
    cache = cache_factory() if cache_factory is not None else tf.DynamicCache()
    dev = prompt_ids.device  # the model's (`LocalRun` moves the prompts there)
    ids_out = torch.full((bsz, max_new_tokens), pad_id, dtype=torch.long, device=dev)
    lp_out = torch.zeros(bsz, max_new_tokens, dtype=torch.float32, device=dev)
    mask = torch.zeros(bsz, max_new_tokens, dtype=torch.bool, device=dev)
    done = torch.zeros(bsz, dtype=torch.bool, device=dev)
    inp = prompt_ids
    pos = torch.arange(prompt_ids.shape[1], device=dev).unsqueeze(0).expand(bsz, -1)
    used = 0
    invariant = is_batch_invariant(model)
    cache_kw = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )
    for t in range(max_new_tokens):
        used = t + 1
        # the cache object is updated in place; its keyword was renamed in transformers 5.x
        out = model(input_ids=inp, position_ids=pos, use_cache=True, **{cache_kw: cache})
        logits = out.logits[:, -1, :].float()
        if greedy:
            nxt = logits.argmax(dim=-1)
        else:
            scaled = logits / temperature
            probs = ops.softmax(scaled) if invariant else torch.softmax(scaled, dim=-1)
            nxt = sample(probs, generator)
        lp = token_logprobs(logits, nxt, temperature, invariant=invariant)
        live = ~done
        ids_out[:, t] = torch.where(live, nxt, torch.full_like(nxt, pad_id))
        lp_out[:, t] = torch.where(live, lp, torch.zeros_like(lp))
        mask[:, t] = live
        done = done | (live & (nxt == eos_id))
        if bool(done.all()):
            break
        inp = ids_out[:, t : t + 1]
        pos = pos[:, -1:] + 1
    # drop the columns no row used (all rows finished early)
    return RolloutBatch(ids_out[:, :used], lp_out[:, :used], mask[:, :used], done)
