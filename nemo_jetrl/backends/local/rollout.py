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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


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


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 ``log_softmax(logits / T)`` gathered at ``ids`` (shared by rollout and trainer)."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return lp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


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
    ids_out = torch.full((bsz, max_new_tokens), pad_id, dtype=torch.long)
    lp_out = torch.zeros(bsz, max_new_tokens, dtype=torch.float32)
    mask = torch.zeros(bsz, max_new_tokens, dtype=torch.bool)
    done = torch.zeros(bsz, dtype=torch.bool)
    inp = prompt_ids
    pos = torch.arange(prompt_ids.shape[1]).unsqueeze(0).expand(bsz, -1)
    used = 0
    for t in range(max_new_tokens):
        used = t + 1
        out = model(input_ids=inp, position_ids=pos, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits = out.logits[:, -1, :].float()
        if greedy:
            nxt = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        lp = token_logprobs(logits, nxt, temperature)
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
