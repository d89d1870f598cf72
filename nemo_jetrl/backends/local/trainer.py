"""Trainer: full-sequence scoring and one GRPO update per step, with fp32 master weights.

The trainer's model is the same HF class as the rollout's, in the BF16 compute dtype, with its
decoder linears swapped for `Fp8BlockLinear` when the recipe trains in FP8 (``jetrl``,
``jetrl_kv``). As in Megatron's mixed-precision optimizer, the optimizer never touches those
compute weights: it holds an fp32 master copy, receives the gradients cast to fp32, runs AdamW,
and writes the master back into the compute weights (rounded to BF16). The refit then ships
exactly the compute weights, which are also what the trainer's FP8 forward quantizes.

Scoring (``prev_logprobs``) is a no-grad forward over prompt + response; the update recomputes
the same forward with gradients (``curr_logprobs``) and minimises `nemo_jetrl.rl.loss.grpo_loss`
(clipped policy gradient, optional importance-sampling correction from ``prev - generation``,
optional k3 KL to the frozen reference policy). A step whose gradient is not finite is skipped
and reported, so the master weights never absorb a NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from nemo_jetrl.backends.local.rollout import token_logprobs
from nemo_jetrl.fp8 import check_non_finite
from nemo_jetrl.invariant import is_batch_invariant
from nemo_jetrl.rl.loss import grpo_loss
from nemo_jetrl.rl.loss_config import GRPOLossConfig


@dataclass(frozen=True)
class OptimConfig:
    """AdamW on the fp32 master weights (NeMo-RL's ``policy.optimizer.kwargs``)."""

    lr: float = 1e-4
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm (None: no clipping, the norm is still logged)."""


def sequence_logprobs(
    model: nn.Module, input_ids: torch.Tensor, prompt_len: int, temperature: float
) -> torch.Tensor:
    """[B, R] logprobs of the response tokens ``input_ids[:, prompt_len:]`` (one forward)."""
    logits = model(input_ids=input_ids, use_cache=False).logits[:, prompt_len - 1 : -1]
    ids = input_ids[:, prompt_len:]
    return token_logprobs(logits, ids, temperature, invariant=is_batch_invariant(model))


class Trainer:
    """Owns the compute model, the fp32 master copy and the optimizer (see module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        optim: OptimConfig,
        loss: GRPOLossConfig,
        temperature: float,
        reference: nn.Module | None = None,
    ) -> None:
        self.model = model
        self.optim_cfg = optim
        self.loss_cfg = loss
        self.temperature = temperature
        self.reference = reference
        self.names = [n for n, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]
        self.master = [p.detach().float().clone() for p in self.params]
        self.optimizer = torch.optim.AdamW(
            self.master,
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            foreach=False,
        )

    # -- weights -------------------------------------------------------------------------------

    @torch.no_grad()
    def load_master(self, weights: dict[str, torch.Tensor]) -> None:
        """Set the fp32 masters (e.g. warm start, checkpoint) and the compute weights from them."""
        missing = [n for n in self.names if n not in weights]
        if missing:
            raise KeyError(f"weights lack {len(missing)} parameter(s), e.g. {missing[:3]}")
        for name, m in zip(self.names, self.master, strict=True):
            src = weights[name]
            if tuple(src.shape) != tuple(m.shape):
                raise ValueError(f"{name}: shape {tuple(src.shape)} != model's {tuple(m.shape)}")
            m.copy_(src.float())
        self._write_back()

    @torch.no_grad()
    def _write_back(self) -> None:
        for p, m in zip(self.params, self.master, strict=True):
            p.copy_(m)  # round-to-nearest-even into the compute dtype

    def master_state(self) -> dict[str, torch.Tensor]:
        return {n: m.detach().clone() for n, m in zip(self.names, self.master, strict=True)}

    # -- forward passes ------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """``prev_logprobs`` [B, R] under the training precision (no gradient)."""
        self.model.eval()
        return sequence_logprobs(self.model, input_ids, prompt_len, self.temperature)

    @torch.no_grad()
    def reference_logprobs(self, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor | None:
        """Reference-policy logprobs, or None when there is no reference model."""
        if self.reference is None:
            return None
        return sequence_logprobs(self.reference, input_ids, prompt_len, self.temperature)

    # -- update --------------------------------------------------------------------------------

    def update(
        self,
        input_ids: torch.Tensor,
        prompt_len: int,
        *,
        prev_logprobs: torch.Tensor,
        generation_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        token_mask: torch.Tensor,
        reference_logprobs: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step on the whole batch; returns the loss metrics (NeMo-RL names)."""
        self.model.train()
        curr = sequence_logprobs(self.model, input_ids, prompt_len, self.temperature)
        loss, metrics = grpo_loss(
            curr,
            prev_logprobs,
            generation_logprobs,
            advantages,
            token_mask,
            reference_logprobs=reference_logprobs,
            config=self.loss_cfg,
        )
        for p in self.params:
            p.grad = None
        loss.backward()
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = None if p.grad is None else p.grad.detach().float()
            p.grad = None
        grads = [m.grad for m in self.master if m.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        grad_norm = float(norm)
        # FP8 layers on CUDA defer their non-finite checks to one read per step (here, where
        # float(norm) already synced); on CPU they raised at the offending quantization.
        check_non_finite()
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            clip = self.optim_cfg.max_grad_norm
            if clip is not None and grad_norm > clip:
                for g in grads:
                    g.mul_(clip / (grad_norm + 1e-6))
            self.optimizer.step()
            self._write_back()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        metrics["train/grad_norm"] = grad_norm
        metrics["train/lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["jetrl/local/update_skipped"] = float(skipped)
        return metrics
