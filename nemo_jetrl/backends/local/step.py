"""One GRPO step of a local run: `RunStep`, the part of `LocalRun` that runs the phases, and the
test/debugging `Hooks` they call. The phases, timed with NeMo-RL's timing names:

1. refit (``timing/train/prepare_for_generation``): the trainer's compute weights go through the
   guarded `refit` (FP8 layers quantized once, 128x128); a refused refit is logged
   (``jetrl/local/refit_refused``) and the rollout keeps its last good weights.
2. rollout (``timing/train/generation``): ``num_prompts_per_step`` problems x
   ``num_generations_per_prompt`` samples with per-token ``generation_logprobs``; rewards
   (``timing/train/reward_calculation``).
3. score (``timing/train/policy_and_reference_logprobs``): the trainer's full-sequence forward
   under the training precision gives ``prev_logprobs`` (and reference logprobs when the KL
   penalty is on); `mismatch_metrics` compares them with the rollout's. An MoE model's routing
   (`nemo_jetrl.backends.local.routing`): recorded in the rollout, compared with the trainer's
   (``jetrl/moe/routing_mismatch``) and, with ``policy.router_replay.enabled``, replayed in the
   scoring and update forwards.
4. update (``timing/train/policy_training``): GRPO loss (group advantages, clipped PG, optional
   IS correction and KL) and one AdamW step on the fp32 masters, undone when it leaves a weight
   non-finite (`nemo_jetrl.backends.local.guard`, ``jetrl/local/update_refused``).
5. recalibrate KV scales (``timing/train/kv_calibration``) when the KV cache is FP8.

With ``jetrl.local.rollout_engine: vllm`` steps 1 and 2 run on a real vLLM CPU engine under the
nemo_jetrl patch (`nemo_jetrl.backends.local.vllm_rollout`): the weights that passed the guarded
refit above go through the vLLM refit (its own guards, then the bit-for-bit parity check, logged
as ``jetrl/local/vllm_parity_tensors``), and vLLM's per-token logprobs are the
``generation_logprobs``. Scoring, metrics, update, logs and checkpoints are unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import torch

from nemo_jetrl.backends.local.bf16_gemm import is_bf16_gemm
from nemo_jetrl.backends.local.device import to_device
from nemo_jetrl.backends.local.guard import guarded_update
from nemo_jetrl.backends.local.refit import (
    RefitRefused,
    commit_refit,
    export_weights,
    stage_refit,
)
from nemo_jetrl.backends.local.rollout import RolloutBatch, generate
from nemo_jetrl.backends.local.task import (
    decode_responses,
    encode_prompts,
    sample_problems,
    score,
)
from nemo_jetrl.invariant import is_batch_invariant
from nemo_jetrl.rl.loss import group_advantages
from nemo_jetrl.rl.metrics import mismatch_metrics

T = "timing/train/"


@dataclass
class Hooks:
    """Test and debugging hooks (not configurable from YAML)."""

    before_refit: Callable[[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    """``fn(step, weights) -> weights``: e.g. corrupt the weights sent to the rollout."""
    after_step: Callable[[int, dict[str, float]], None] | None = None
    """``fn(step, scalars)`` after each step is logged."""
    on_run: Callable[[Any], None] | None = None
    """``fn(run)`` with the `LocalRun` once its state is built (e.g. to inspect its rollout
    engine later); typed Any because `LocalRun` is built from this module's `RunStep`."""


class RunStep:
    """The phases of one step; mixed into `nemo_jetrl.backends.local.setup.LocalRun`, whose
    state (trainer, rollout model or engine, KV controller, generators) they use."""

    _updated_since_refit = False
    """An update came after the rollout's last refit (NeMo-RL's ``POLICY_GENERATION_STALE``)."""
    _validation_refit: tuple[bool, str | None] | None = None
    """The outcome of the refit `validate` made, for the next step to report as its own."""
    rollout_source: dict[str, torch.Tensor] | None = None
    """What the rollout's last accepted refit loaded (a copy, kept only when the run saves
    checkpoints; None: the weights the run started with): a checkpoint taken while refits are
    refused holds it, so a resumed run rolls out from the same last good weights."""
    rollout_stale = False
    """The last refit was refused: the rollout holds `rollout_source`, not the trainer's."""

    def engine_kv_scales(self) -> dict[int, dict[str, float]] | None:
        """The trainer's calibrated KV scales for the vLLM engine (None: no FP8 KV / not yet).

        A tensor without a calibrated scale gets vLLM's default 1.0, as the trainer assumes."""
        if self.kv is None or self.kv.scales is None:
            return None
        return {
            i: {t: float(per.get(t, 1.0)) for t in ("q", "k", "v")}
            for i, per in self.kv.scales.layers.items()
        }

    def do_refit(self, hooks: Hooks, *, count: bool = True) -> tuple[bool, str | None]:
        """Refit the rollout with the trainer's weights: (accepted, why refused). A refusal
        adds to ``refit_refused_total`` unless ``count`` is False (validation's refit: the step
        that uses it counts it, so a checkpoint between them holds the same total as a run
        resumed from it reaches)."""
        weights = export_weights(self.trainer.model)
        if hooks.before_refit is not None:
            weights = hooks.before_refit(self.step + 1, dict(weights))
        ok, why = self.load_rollout(weights)
        self.refit_refused_total += int(count and not ok)
        self.rollout_stale = not ok
        if ok and self.run.checkpoint_enabled:  # the trainer's update overwrites them in place
            self.rollout_source = {k: v.detach().clone() for k, v in weights.items()}
        return ok, why

    def load_rollout(self, weights: dict[str, torch.Tensor]) -> tuple[bool, str | None]:
        """Load ``weights`` (trainer names) into the rollout through the guarded refit and the
        vLLM engine's (if any): (accepted, why refused); refused, nothing changed."""
        try:  # checked first, stored only once the engine (if any) accepted its refit too
            staged = stage_refit(self.rollout_model, weights)
        except RefitRefused as exc:
            return False, str(exc)
        if self.engine is not None:
            from nemo_jetrl.vllm_patch.refit import RefitError

            try:  # vLLM's own guards; a ParityError (bits differ) is raised, never swallowed
                rep = self.engine.refit(weights, kv_scales=self.engine_kv_scales())
                self.engine_parity_tensors = rep.parity_compared
                self.engine_kv_layers = rep.kv_layers
            except RefitError as exc:
                return False, f"vLLM engine: {exc}"
        commit_refit(staged)
        return True, None

    def _generate(self, prompt_ids: torch.Tensor, generator: torch.Generator, *, greedy: bool):
        """Rollout on the configured engine (HF model or vLLM), on ``self.device``."""
        kw = dict(
            max_new_tokens=self.max_new_tokens,
            temperature=self.run.temperature,
            eos_id=self.tokenizer.eos_token_id,
            pad_id=self.tokenizer.pad_token_id,
            generator=generator,
            greedy=greedy,
        )
        if self.engine is not None:  # vLLM answers on the host; the rest of the step runs here
            rb = self.engine.generate(prompt_ids.cpu(), **kw)
            return RolloutBatch(
                **{f.name: to_device(getattr(rb, f.name), self.device) for f in fields(rb)}
            )
        prompt_ids = to_device(prompt_ids, self.device)
        return generate(self.rollout_model, prompt_ids, cache_factory=self._cache_factory(), **kw)

    def _cache_factory(self):
        return self.kv.rollout_cache if self.kv is not None else None

    def validate(self, hooks: Hooks | None = None) -> dict[str, float]:
        """Validation accuracy of the current policy: the rollout is refit first when an update
        came after its last refit (NeMo-RL refits a stale generation before validating); the
        next step then uses that refit instead of making its own."""
        t0 = time.perf_counter()
        if self._updated_since_refit:
            self._validation_refit = self.do_refit(hooks or Hooks(), count=False)
            self._updated_since_refit = False
        rows, where = self._validation_rows()
        prompts = encode_prompts(rows, self.tokenizer)
        g = torch.Generator().manual_seed(self.run.seed + 1000 + self.step)
        rb = self._generate(prompts, g, greedy=self.local.val_greedy)
        texts, finished, mask = decode_responses(rb.response_ids, self.tokenizer)
        results = [
            score(p, texts[i], finished[i], self.task)
            for p, i in zip(self.val_problems, where, strict=True)
        ]
        return {
            "validation/accuracy": sum(c for _, c in results) / len(results),
            "validation/avg_reward": sum(r for r, _ in results) / len(results),
            "validation/avg_length": float(mask.sum(1).float()[where].mean()),
            "timing/validation/total_validation_time": time.perf_counter() - t0,
        }

    def _validation_rows(self) -> tuple[list[Any], list[int]]:
        """The validation problems to decode and, per validation problem, its row among them.

        256 draws of the 200 one-operation problems hold only ~145-150 distinct ones. Greedy
        decoding where every op is batch-invariant (`nemo_jetrl.invariant` plus FP8 linears with
        the exact, order-free GEMM, no BF16 GEMM left) gives a prompt the same response whatever
        else is in the batch, so each distinct prompt is decoded once (same metrics, ~40% fewer
        rows). Sampled validation, BF16 decoder GEMMs (their rounding may depend on the row
        count), HF's ops and the vLLM engine decode every row."""
        problems = self.val_problems
        plan = self.rollout_plan.config
        if not (
            self.local.val_greedy
            and self.engine is None
            and is_batch_invariant(self.rollout_model)
            and plan is not None
            and plan.exact_gemm
            and not any(is_bf16_gemm(m) for m in self.rollout_model.modules())
        ):
            return problems, list(range(len(problems)))
        index: dict[str, int] = {}
        rows = []
        for p in problems:
            if p.prompt not in index:
                index[p.prompt] = len(rows)
                rows.append(p)
        return rows, [index[p.prompt] for p in problems]

    def train_step(self, hooks: Hooks) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """One GRPO step (see the module docstring); returns (scalars, train-data records)."""
        clock = _PhaseClock()
        s: dict[str, float] = {}
        with clock.phase("prepare_for_generation"):  # 1. refit (done by validation, if it ran)
            done, self._validation_refit = self._validation_refit, None
            ok, why = done if done is not None else self.do_refit(hooks)
            if done is not None and not ok:
                self.refit_refused_total += 1  # validation's refusal, counted by its step
        self._note_refit(s, ok, why)
        with clock.phase("generation"), self.routing.rollout():  # 2. rollout + rewards
            problems, prompt_ids, rb = self._rollout(s)
        with clock.phase("reward_calculation"):
            b = self._rewards(problems, prompt_ids, rb)
        with clock.phase("policy_and_reference_logprobs"):  # 3. score
            P = prompt_ids.shape[1]
            ids = torch.cat([prompt_ids, rb.response_ids], dim=1)
            with self.routing.training(record=True):
                prev = self.trainer.score(ids, P)
            ref = self.trainer.reference_logprobs(ids, P)
        gen = rb.generation_logprobs
        kl_type = self.trainer.loss_cfg.reference_policy_kl_type
        s.update(mismatch_metrics(gen, prev, b.mask, kl_type=kl_type))
        s.update(self.routing.metrics(P, b.mask))
        with clock.phase("policy_training"), self.routing.training(record=False):  # 4. update
            lm, refused = guarded_update(
                self.trainer,
                ids,
                P,
                prev_logprobs=prev,
                generation_logprobs=gen,
                advantages=b.adv,
                token_mask=b.mask,
                reference_logprobs=ref,
            )
        self._updated_since_refit = True
        if refused:
            self.log(f"step {self.step + 1}: {refused}")
        s.update(lm)
        if self.kv is not None:  # 5. KV recalibration on this step's data, with the updated weights
            with clock.phase("kv_calibration"):
                refused_layers = self._recalibrate_kv(ids, prompt_ids, b.mask)
            s["jetrl/local/kv_refused_layers"] = float(refused_layers)
        self.step += 1
        s.update(self._step_summary(b, rb))
        s.update(clock.totals())
        return s, _records(b, ids, gen, prev, P)

    def _note_refit(self, s: dict[str, float], ok: bool, why: str | None) -> None:
        """Record the refit outcome in the step scalars and log a refusal."""
        s["jetrl/local/refit_refused"] = 0.0 if ok else 1.0
        if self.engine is not None:
            s["jetrl/local/vllm_parity_tensors"] = float(self.engine_parity_tensors if ok else 0)
        if not ok:
            self.log(f"step {self.step + 1}: {why}")

    def _rollout(self, s: dict[str, float]) -> tuple[list[Any], torch.Tensor, RolloutBatch]:
        """Sample this step's problems and roll out G samples each; returns (problems, prompt ids
        repeated per sample, rollout batch)."""
        G = self.run.num_generations_per_prompt
        problems = sample_problems(self.run.num_prompts_per_step, self.task, self.data_gen)
        prompt_ids = encode_prompts(problems, self.tokenizer).repeat_interleave(G, dim=0)
        prompt_ids = to_device(prompt_ids, self.device)
        if self.kv is not None and not self.kv_calibrated:
            self._first_kv_calibration(prompt_ids)
        if self.engine is not None and self.kv is not None:  # layers whose scales this rollout uses
            s["jetrl/local/vllm_kv_layers"] = float(self.engine_kv_layers)
        rb = self._generate(prompt_ids, self.sample_gen, greedy=False)
        routed = getattr(self.engine, "last_routing", None)
        if routed is not None and self.routing.active:  # the engine's routing of this rollout
            choices, valid = routed  # on the host, like the engine's tokens
            dev = self.device
            self.routing.set_rollout([to_device(c, dev) for c in choices], to_device(valid, dev))
        return problems, prompt_ids, rb

    def _first_kv_calibration(self, prompt_ids: torch.Tensor) -> None:
        """First step: no responses yet, so the initial KV scales come from the prompts."""
        self.kv.calibrate(self.trainer.model, prompt_ids, mask="prompt_and_response")
        self.kv_calibrated = True
        if self.engine is not None:  # the engine's KV cache takes the same scales
            self.engine_kv_layers = self.engine.set_kv_scales(self.engine_kv_scales())

    def _rewards(self, problems: list[Any], prompt_ids: torch.Tensor, rb: RolloutBatch) -> _Scored:
        """Decode and score the responses; group advantages over each prompt's samples."""
        G = self.run.num_generations_per_prompt
        texts, finished, mask = decode_responses(rb.response_ids, self.tokenizer)
        owners = [p for p in problems for _ in range(G)]
        scored = [
            score(p, t, f, self.task) for p, t, f in zip(owners, texts, finished, strict=True)
        ]
        rewards = torch.tensor([r for r, _ in scored], dtype=torch.float64)
        group_ids = torch.arange(len(problems)).repeat_interleave(G)
        adv = group_advantages(
            rewards,
            group_ids,
            normalize_rewards=self.run.normalize_rewards,
            leave_one_out_baseline=self.run.use_leave_one_out_baseline,
        )
        return _Scored(texts, mask, scored, rewards, to_device(adv, self.device))

    def _recalibrate_kv(
        self, ids: torch.Tensor, prompt_ids: torch.Tensor, mask: torch.Tensor
    ) -> int:
        """Recalibrate the KV scales on prompts + responses; returns the refused layer count."""
        full_mask = torch.cat([torch.ones_like(prompt_ids, dtype=torch.bool), mask], dim=1)
        resp_mask = torch.cat([torch.zeros_like(prompt_ids, dtype=torch.bool), mask], dim=1)
        res = self.kv.calibrate(self.trainer.model, ids, full_mask, resp_mask)
        return len(res.refused)

    def _step_summary(self, b: _Scored, rb: RolloutBatch) -> dict[str, float]:
        """Reward, accuracy and rollout-shape scalars of the finished step."""
        return {
            "train/reward": float(b.rewards.mean()),
            "train/accuracy": sum(c for _, c in b.scored) / len(b.scored),
            "jetrl/local/mean_response_tokens": float(b.mask.sum(1).float().mean()),
            "jetrl/local/frac_finished": float(rb.finished.float().mean()),
            "jetrl/local/refit_refused_total": float(self.refit_refused_total),
        }


class _PhaseClock:
    """Wall and CPU seconds per step phase, under NeMo-RL's timing names."""

    def __init__(self) -> None:
        self.timing: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.t_start, self.c_start = time.perf_counter(), time.process_time()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase ``name`` (not recorded when it raises: the step is lost)."""
        t0, c0 = time.perf_counter(), time.process_time()
        yield
        self.timing[T + name] = time.perf_counter() - t0
        self.cpu["jetrl/local/cpu_time/" + name] = time.process_time() - c0

    def totals(self) -> dict[str, float]:
        """All phase times plus the whole step's, wall times first."""
        self.timing[T + "total_step_time"] = time.perf_counter() - self.t_start
        self.cpu["jetrl/local/cpu_time/total_step_time"] = time.process_time() - self.c_start
        return {**self.timing, **self.cpu}


@dataclass
class _Scored:
    """A step's decoded, scored responses and their group advantages."""

    texts: list[str]
    mask: torch.Tensor
    scored: list[tuple[float, bool]]
    rewards: torch.Tensor
    adv: torch.Tensor


def _records(
    b: _Scored, ids: torch.Tensor, gen: torch.Tensor, prev: torch.Tensor, P: int
) -> list[dict[str, Any]]:
    """Per-sample train-data records (NeMo-RL's jsonl layout, prompt positions padded)."""
    records = []
    ids, gen, prev, mask, adv = (
        t.cpu() for t in (ids, gen, prev, b.mask, b.adv)
    )  # once, not per row
    for i in range(ids.shape[0]):
        pad = [0.0] * P
        records.append(
            {
                "content": b.texts[i],
                "token_ids": ids[i].tolist(),
                "generation_logprobs": pad + gen[i].tolist(),
                "prev_logprobs": pad + prev[i].tolist(),
                "token_loss_mask": [0] * P + mask[i].int().tolist(),
                "sample_loss_mask": 1,
                "rewards": float(b.rewards[i]),
                "advantages": float(adv[i]),
            }
        )
    return records
