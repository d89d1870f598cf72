"""Routing across the two sides of an MoE run: the rollout's expert choices recorded, compared
with the trainer's, and (``policy.router_replay.enabled``) replayed in the trainer (R3).

Per step (`RunStep.train_step`):

1. `rollout`: every `MoeBlock` of the rollout model records its top-k per forward (the prompt's
   prefill, then one decode step per token), giving per layer ``[B, P + R - 1, k]`` int32: every
   position the rollout computed (the last sampled token is never fed back).
2. `training`: the trainer's blocks record their own top-k from the scoring forward and, with
   replay on, use the rollout's experts at every recorded position (own choice at the last one,
   whose output no logprob reads).
3. `metrics`: ``jetrl/moe/routing_mismatch``, the fraction of (token, top-k slot) expert
   choices of the rollout that the trainer's own top-k does not contain, over the positions
   that produce real response tokens' logprobs (``P - 1 + t`` for each unmasked response token
   ``t``) and every MoE layer. Under replay it still compares the trainer's *own* choices: what
   replay removed. A dense model has no blocks: everything here is a no-op and no metric.

With the vLLM rollout engine (`use_engine`), step 1 is the engine's own routing, recorded
inside it (`nemo_jetrl.vllm_patch.routing_capture`) and handed over by `set_rollout` with a mask
of the positions it holds; the metric compares those positions only and
``jetrl/moe/routing_captured_frac`` says how many response tokens that was. Where the engine's
routing cannot be recorded, no metric is logged (never a made-up 0).

Cost of replay: k int32 per token per MoE layer kept from rollout to update.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from nemo_jetrl.backends.local.moe import MoeBlock, moe_blocks

ROUTING_MISMATCH = "jetrl/moe/routing_mismatch"
# vLLM rollout: the fraction of response tokens whose rollout routing the engine's capture holds
ROUTING_CAPTURED = "jetrl/moe/routing_captured_frac"


class RoutingController:
    """Record, replay and compare the routing of one run's rollout and training models."""

    def __init__(self, rollout_model: nn.Module, train_model: nn.Module, *, replay: bool) -> None:
        self.rollout_blocks: list[MoeBlock] = moe_blocks(rollout_model)
        self.train_blocks: list[MoeBlock] = moe_blocks(train_model)
        if len(self.rollout_blocks) != len(self.train_blocks):
            raise ValueError(
                f"rollout has {len(self.rollout_blocks)} MoE blocks, trainer "
                f"{len(self.train_blocks)}: the two sides must be the same model"
            )
        self.replay = replay
        self.rollout_choices: list[torch.Tensor] | None = None
        self.rollout_valid: torch.Tensor | None = None
        """``[B, S]`` positions the rollout's record holds (None: all of them)."""
        self.train_choices: list[torch.Tensor] | None = None
        self.external = False
        """The rollout runs in the vLLM engine: its choices come through `set_rollout`."""
        self.unavailable: str | None = None
        """Why the rollout's routing is unknown (the metric is then not logged)."""

    def use_engine(self, unavailable: str | None) -> None:
        """The rollout runs in a vLLM engine whose routing arrives by `set_rollout` (or is
        unknown, ``unavailable`` saying why)."""
        self.external, self.unavailable = True, unavailable

    def set_rollout(self, choices: list[torch.Tensor], valid: torch.Tensor) -> None:
        """The engine's routing of this step's rollout (`vllm_moe.routing_tensors`)."""
        if len(choices) != len(self.train_blocks):
            raise ValueError(f"{len(choices)} routed layers, trainer {len(self.train_blocks)}")
        self.rollout_choices, self.rollout_valid = choices, valid

    @property
    def active(self) -> bool:
        return bool(self.train_blocks)

    def _set_record(self, blocks: list[MoeBlock], on: bool) -> None:
        for b in blocks:
            b.record = [] if on else None

    @contextmanager
    def rollout(self) -> Iterator[None]:
        """Record the rollout's top-k during generation (`rollout_choices`)."""
        if not self.active:
            yield
            return
        if self.external:  # the engine's capture arrives through set_rollout
            self.rollout_choices = self.rollout_valid = None
            yield
            return
        self._set_record(self.rollout_blocks, True)
        try:
            yield
            self.rollout_choices = [torch.cat(b.record or [], dim=1) for b in self.rollout_blocks]
        finally:
            self._set_record(self.rollout_blocks, False)

    @contextmanager
    def training(self, *, record: bool) -> Iterator[None]:
        """Trainer forwards inside: replay the recorded rollout choices (when on) and, with
        ``record``, keep the trainer's own top-k (`train_choices`)."""
        if not self.active:
            yield
            return
        if self.replay:
            if self.rollout_choices is None:
                raise RuntimeError("routing replay: no rollout routing was recorded this step")
            for b, rec in zip(self.train_blocks, self.rollout_choices, strict=True):
                valid = self.rollout_valid
                if valid is None:
                    valid = torch.ones(rec.shape[:2], dtype=torch.bool, device=rec.device)
                # the last position was never fed to the rollout: the trainer routes it itself
                b.replay = (_pad_one(rec), _pad_one(valid.unsqueeze(-1)).squeeze(-1))
        if record:
            self._set_record(self.train_blocks, True)
        try:
            yield
            if record:
                self.train_choices = [b.record[0] for b in self.train_blocks]  # type: ignore[index]
        finally:
            for b in self.train_blocks:
                b.replay, b.record = None, None

    def metrics(self, prompt_len: int, mask: torch.Tensor) -> dict[str, float]:
        """``jetrl/moe/routing_mismatch`` of this step (see the module docstring)."""
        if not self.active or self.unavailable is not None:
            return {}
        if self.rollout_choices is None or self.train_choices is None:
            raise RuntimeError("routing metrics need this step's rollout and trainer routing")
        r = mask.shape[1]
        sel = mask.bool()
        out = {}
        if self.rollout_valid is not None:  # the engine's capture: positions it recorded
            seen = self.rollout_valid[:, prompt_len - 1 : prompt_len - 1 + r]
            out[ROUTING_CAPTURED] = float((seen & sel).sum()) / max(1, int(sel.sum()))
            sel = sel & seen
        differ = total = 0
        for roll, own in zip(self.rollout_choices, self.train_choices, strict=True):
            a = roll[:, prompt_len - 1 : prompt_len - 1 + r].long()  # [B, R, k]
            t = own[:, prompt_len - 1 : prompt_len - 1 + r].long()
            found = (a.unsqueeze(-1) == t.unsqueeze(-2)).any(-1)  # [B, R, k]
            differ += int((~found & sel.unsqueeze(-1)).sum())
            total += int(sel.sum()) * a.shape[-1]
        if total:  # no compared choice: no value (never a made-up 0)
            out[ROUTING_MISMATCH] = differ / total
        return out


def _pad_one(t: torch.Tensor) -> torch.Tensor:
    """``t [B, S, ...]`` with one more position of zeros (False) along dim 1."""
    return torch.cat([t, torch.zeros_like(t[:, :1])], dim=1)
