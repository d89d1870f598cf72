"""Rollout: incremental generation with a KV cache, temperature sampling, per-token logprobs.

This is the local stand-in for vLLM: the rollout model (with `Fp8InferenceLinear` layers under
an FP8 rollout recipe) runs one forward over the prompts, then one token at a time, reusing the
transformers KV cache (an FP8 one under ``jetrl_kv``). For each sampled token it records
``generation_logprobs``: log softmax of ``logits / temperature`` at the sampled id, in fp32, the
same quantity the trainer computes from its full-sequence forward (``prev_logprobs``). Rows that
emitted ``<eos>`` keep generating ``<pad>`` (masked out) until every row finished (read on the
host every few steps only, see `generate`) or ``max_new_tokens`` is reached. Sampling draws
from an explicit ``torch.Generator`` so a run is reproducible and resumable.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nemo_jetrl.backends.local.moe import moe_blocks
from nemo_jetrl.invariant import is_batch_invariant, ops
from nemo_jetrl.invariant.hf import positions_bounded


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


DEVICE_STOP_CHECK_EVERY = 4
"""Decode steps between host reads of "every row finished" on an accelerator (see `generate`):
each read waits for the device, each step past the last row's ``<eos>`` is wasted work."""


def _default_generator(dev: torch.device) -> torch.Generator | None:
    """The generator ``torch.multinomial(generator=None)`` draws from on ``dev`` (None: unknown)."""
    if dev.type == "cpu":
        return torch.default_generator
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[idx]
    return None


class _Marks:
    """What each decode step left behind that a step past the stop must not: the sampling
    generator's state and the length of every routing record (MoE blocks append one entry per
    forward while `routing.RoutingController.rollout` records). `undo_after` puts back the
    marks of a step, so steps run past it leave no trace (same draws later, same records)."""

    def __init__(self, model: nn.Module, generator: torch.Generator | None) -> None:
        self.generator = generator
        self.records = [m.record for m in moe_blocks(model) if m.record is not None]
        self.first = 0  # the step of states[0]
        self.states: list[torch.Tensor] = []
        self.lengths: list[list[int]] = []

    def step(self) -> None:
        """Mark the step that just ran (a host-side copy: no device work)."""
        if self.generator is not None:
            self.states.append(self.generator.get_state())
        self.lengths.append([len(r) for r in self.records])

    def forget_before(self, step: int) -> None:
        """Drop the marks of steps before ``step`` (the last check found rows still going)."""
        drop = step - self.first
        del self.states[:drop], self.lengths[:drop]
        self.first = step

    def undo_after(self, step: int) -> None:
        """Back to the moment right after ``step`` (a step at or after the last `forget_before`)."""
        i = step - self.first
        if self.generator is not None:
            self.generator.set_state(self.states[i])
        for r, n in zip(self.records, self.lengths[i], strict=True):
            del r[n:]


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
    stop_check_every: int | None = None,
) -> RolloutBatch:
    """Sample up to ``max_new_tokens`` per row (see the module docstring).

    Nothing in a decode step reads a device value on the host: whether every row finished is
    read once every ``stop_check_every`` steps (None: every step on CPU, where a read waits for
    nothing and a step past the stop costs real compute; `DEVICE_STOP_CHECK_EVERY` on an
    accelerator) and after the last step. Any value gives the same result bit for bit and leaves
    ``generator`` in the same state: the columns of steps run past the one where the last row
    finished are dropped and their draws undone (`_Marks`), so later draws, and a resumed run,
    do not depend on it."""
    every = stop_check_every
    if every is None:
        every = 1 if prompt_ids.device.type == "cpu" else DEVICE_STOP_CHECK_EVERY
    if every < 1:
        raise ValueError(f"stop_check_every={stop_check_every}: use a positive step count")
    tf = __import__("transformers")
    bsz, prompt_len = prompt_ids.shape
    dev = prompt_ids.device  # the model's (`LocalRun` moves the prompts there)
    if generator is None and not greedy:
        generator = _default_generator(dev)
        every = every if generator is not None else 1  # nothing to undo draws with: stop at once
    ids_out = torch.full((bsz, max_new_tokens), pad_id, dtype=torch.long, device=dev)
    lp_out = torch.zeros(bsz, max_new_tokens, dtype=torch.float32, device=dev)
    mask = torch.zeros(bsz, max_new_tokens, dtype=torch.bool, device=dev)
    done = torch.zeros(bsz, dtype=torch.bool, device=dev)
    inp = prompt_ids
    pos = torch.arange(prompt_len, device=dev).unsqueeze(0).expand(bsz, -1)
    used = 0
    invariant = is_batch_invariant(model)
    cache_kw = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )
    marks = _Marks(model, None if greedy else generator)
    cache = cache_factory() if cache_factory is not None else tf.DynamicCache()
    # the positions are known here: one rotary bounds check per call, not a read per forward
    with positions_bounded(model, prompt_len + max(max_new_tokens - 1, 0)):
        for t in range(max_new_tokens):
            # the cache object is updated in place; its keyword was renamed in transformers 5.x
            out = model(input_ids=inp, position_ids=pos, use_cache=True, **{cache_kw: cache})
            logits = out.logits[:, -1, :].float()
            if greedy:
                nxt = logits.argmax(dim=-1)
            else:
                scaled = logits / temperature
                probs = ops.softmax(scaled) if invariant else torch.softmax(scaled, dim=-1)
                nxt = sample(probs, generator)
            marks.step()
            lp = token_logprobs(logits, nxt, temperature, invariant=invariant)
            live = ~done
            ids_out[:, t] = torch.where(live, nxt, torch.full_like(nxt, pad_id))
            lp_out[:, t] = torch.where(live, lp, torch.zeros_like(lp))
            mask[:, t] = live
            done = done | (live & (nxt == eos_id))
            used = t + 1
            if used % every == 0 or used == max_new_tokens:
                # one host read: steps with a live row so far, +1 while a row is still going
                steps = max(int(mask[:, :used].any(dim=0).sum() + (~done).any()), 1)
                if steps <= used:  # every row finished, at step steps - 1
                    if steps < used:
                        marks.undo_after(steps - 1)
                    used = steps
                    break
                marks.forget_before(used)
            inp = ids_out[:, t : t + 1]
            pos = pos[:, -1:] + 1
    # drop the columns no row used (all rows finished early)
    return RolloutBatch(ids_out[:, :used], lp_out[:, :used], mask[:, :used], done)
