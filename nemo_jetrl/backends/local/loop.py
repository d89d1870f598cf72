"""The local GRPO loop: refit, rollout, score, metrics, update (and KV recalibration) every step.

One step, as in DESIGN.md ("One RL step"), timed per phase with NeMo-RL's timing names:

1. refit (``timing/train/prepare_for_generation``): the trainer's compute weights go through the
   guarded `refit` (FP8 layers quantized once, 128x128); a refused refit is logged
   (``jetrl/local/refit_refused``) and the rollout keeps its last good weights.
2. rollout (``timing/train/generation``): ``num_prompts_per_step`` problems x
   ``num_generations_per_prompt`` samples with per-token ``generation_logprobs``; rewards
   (``timing/train/reward_calculation``).
3. score (``timing/train/policy_and_reference_logprobs``): the trainer's full-sequence forward
   under the training precision gives ``prev_logprobs`` (and reference logprobs when the KL
   penalty is on); `mismatch_metrics` compares them with the rollout's.
4. update (``timing/train/policy_training``): GRPO loss (group advantages, clipped PG, optional
   IS correction and KL) and one AdamW step on the fp32 masters.
5. recalibrate KV scales (``timing/train/kv_calibration``) when the KV cache is FP8.

With ``jetrl.local.rollout_engine: vllm`` steps 1 and 2 run on a real vLLM CPU engine under the
nemo_jetrl patch (`nemo_jetrl.backends.local.vllm_rollout`): the weights that passed the guarded
refit above go through the vLLM refit (its own guards, then the bit-for-bit parity check, logged
as ``jetrl/local/vllm_parity_tensors``), and vLLM's per-token logprobs are the
``generation_logprobs``. Scoring, metrics, update, logs and checkpoints are unchanged.

Logs go to ``logger.log_dir`` in NeMo-RL's layout through `nemo_jetrl.runs.logs.RunWriter`;
validation accuracy every ``grpo.val_period`` steps; a checkpoint every
``checkpointing.save_period`` steps; ``resume=True`` continues from the latest checkpoint with
the same weights, optimizer state, RNG states and KV scales, so the resumed steps reproduce an
uninterrupted run exactly.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from nemo_jetrl._optional import require
from nemo_jetrl.backends.local import checkpoint as ckpt
from nemo_jetrl.backends.local.config import LocalSettings, RunSettings
from nemo_jetrl.backends.local.model import build_model, load_model_config
from nemo_jetrl.backends.local.precision import (
    freeze,
    make_rollout_model,
    make_trainer_model,
    model_dtype,
)
from nemo_jetrl.backends.local.refit import RefitRefused, export_weights, refit
from nemo_jetrl.backends.local.rollout import generate
from nemo_jetrl.backends.local.task import (
    decode_responses,
    encode_prompts,
    sample_problems,
    score,
    validation_problems,
)
from nemo_jetrl.backends.local.tokenizer import TOKENIZER_JSON, load_tokenizer
from nemo_jetrl.backends.local.trainer import OptimConfig, Trainer
from nemo_jetrl.backends.local.warmstart import load_or_train
from nemo_jetrl.config.load import ConfigError, ConfigIssue
from nemo_jetrl.recipe import Recipe
from nemo_jetrl.rl.loss import group_advantages
from nemo_jetrl.rl.loss_config import GRPOLossConfig
from nemo_jetrl.rl.metrics import mismatch_metrics

T = "timing/train/"


@dataclass
class Hooks:
    """Test and debugging hooks (not configurable from YAML)."""

    before_refit: Callable[[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    """``fn(step, weights) -> weights``: e.g. corrupt the weights sent to the rollout."""
    after_step: Callable[[int, dict[str, float]], None] | None = None
    """``fn(step, scalars)`` after each step is logged."""
    on_run: Callable[[LocalRun], None] | None = None
    """``fn(run)`` once the run's state is built (e.g. to inspect its rollout engine later)."""


@dataclass
class RunResult:
    """What `run_local` did."""

    log_dir: Path
    recipe: str
    first_step: int
    last_step: int
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0


def _loss_config(cfg: DictConfig) -> GRPOLossConfig:
    from nemo_jetrl.rl.correction import CorrectionConfigError

    section = OmegaConf.select(cfg, "loss_fn", default=None)
    if section is None:
        return GRPOLossConfig(reference_policy_kl_penalty=0.0)
    try:
        return GRPOLossConfig.from_loss_fn_cfg(OmegaConf.to_container(section, resolve=True))
    except CorrectionConfigError as exc:
        raise ConfigError([ConfigIssue("loss_fn", e) for e in exc.errors]) from None


def resolve_run(cfg: DictConfig) -> tuple[Recipe, RunSettings, LocalSettings, GRPOLossConfig]:
    """Recipe and settings of a local run; `ConfigError` listing every problem."""
    from nemo_jetrl.config import recipe_from_config

    issues: list[ConfigIssue] = []
    out: list[Any] = []
    checks = (
        lambda: recipe_from_config(cfg),
        lambda: RunSettings.from_cfg(cfg),
        lambda: LocalSettings.from_cfg(OmegaConf.select(cfg, "jetrl.local", default=None)),
        lambda: _loss_config(cfg),
    )
    for fn in checks:
        try:
            out.append(fn())
        except ConfigError as exc:
            new = [i for i in exc.issues if i.level == "error"]
            if fn is checks[-1] and any(i.path.startswith("loss_fn") for i in issues):
                new = []  # the config validator already named these loss_fn problems
            issues.extend(new)
            out.append(None)
    recipe, local = out[0], out[2]
    if local is not None and local.rollout_engine == "vllm":
        from nemo_jetrl.backends.local.vllm_rollout import vllm_importable, vllm_recipe_issues

        if recipe is not None:
            issues.extend(vllm_recipe_issues(recipe, local.dtype))
        issues.extend(vllm_importable())
    if issues:
        seen, unique = set(), []
        for i in issues:
            if (i.path, i.message) not in seen:
                seen.add((i.path, i.message))
                unique.append(i)
        raise ConfigError(unique)
    return tuple(out)  # type: ignore[return-value]


class LocalRun:
    """All state of one local GRPO run (models, trainer, generators, KV controller, writer)."""

    def __init__(self, cfg: DictConfig, *, log=print) -> None:
        self.cfg = cfg
        self.log = log
        self.recipe, self.run, self.local, loss_cfg = resolve_run(cfg)
        if self.local.num_threads:
            torch.set_num_threads(self.local.num_threads)
        self.tokenizer = load_tokenizer(self.local.tokenizer)
        tok_path = Path(self.local.tokenizer) if self.local.tokenizer else TOKENIZER_JSON
        self.model_config = load_model_config(self.local.model_config)
        self.task = self.local.task
        seed = self.run.seed
        dtype = model_dtype(self.local.dtype)
        if self.local.warmstart.enabled and self.local.warmstart.steps > 0:
            weights, path, cached = load_or_train(
                self.model_config,
                self.tokenizer,
                tok_path.read_text(),
                self.task,
                self.local.warmstart,
                seed,
                self.local.resolved_cache_dir(),
                log=log,
            )
            self.warmstart_path: Path | None = path
            self.warmstart_cached = cached
        else:
            weights = build_model(self.model_config, seed=seed).state_dict()
            self.warmstart_path, self.warmstart_cached = None, False
        # trainer side
        train_model = build_model(self.model_config, dtype=dtype, seed=seed)
        self.train_plan = make_trainer_model(train_model, self.recipe)
        reference = None
        if loss_cfg.reference_policy_kl_penalty != 0.0:
            reference = freeze(copy.deepcopy(train_model))
        self.trainer = Trainer(
            train_model,
            optim=OptimConfig(
                lr=self.run.lr,
                betas=self.run.betas,
                eps=self.run.eps,
                weight_decay=self.run.weight_decay,
                max_grad_norm=self.run.max_grad_norm,
            ),
            loss=loss_cfg,
            temperature=self.run.temperature,
            reference=reference,
        )
        self.trainer.load_master(weights)
        if reference is not None:
            with torch.no_grad():
                for p, src in zip(reference.parameters(), train_model.parameters(), strict=True):
                    p.copy_(src)
        # rollout side: same class and config, FP8 layers as the rollout recipe says
        rollout_model = build_model(self.model_config, dtype=dtype, seed=seed)
        rollout_model.load_state_dict(train_model.state_dict(), strict=True)
        self.rollout_plan = make_rollout_model(rollout_model, self.recipe)
        self.rollout_model = freeze(rollout_model)
        self.engine = None  # a VllmRollout with rollout_engine=vllm
        self.engine_parity_tensors = 0
        self.engine_kv_layers = 0
        # FP8 KV cache
        self.kv = None
        if self.recipe.kv_fp8:
            from nemo_jetrl.kvcache import CalibrationSettings
            from nemo_jetrl.kvcache.hf import KVCacheController

            self.kv = KVCacheController(CalibrationSettings.from_recipe(self.recipe.kv_calibration))
            self.kv.attach(self.rollout_model, role="rollout")
            self.kv.attach(train_model, role="train", onpolicy=self.recipe.onpolicy_kv)
        self.data_gen = torch.Generator().manual_seed(seed + 2)
        self.sample_gen = torch.Generator().manual_seed(seed + 3)
        self.val_problems = validation_problems(self.task, seed)
        self.max_new_tokens = self.run.max_new_tokens or self.task.response_len() + 4
        self.step = 0
        self.refit_refused_total = 0
        self.kv_calibrated = False
        if self.local.rollout_engine == "vllm":
            self._start_engine()

    def _start_engine(self) -> None:
        """Start the vLLM engine on a run-local model dir and load the trainer's weights."""
        from nemo_jetrl.backends.local.vllm_rollout import VllmRollout

        prompt_len = encode_prompts(self.val_problems[:1], self.tokenizer).shape[1]
        batch = max(self.run.batch_size, len(self.val_problems))
        self.engine = VllmRollout(
            self.rollout_model,
            self.tokenizer,
            self.recipe,
            Path(self.run.log_dir) / "vllm_model",
            max_model_len=min(
                self.model_config.max_position_embeddings, prompt_len + self.max_new_tokens + 16
            ),
            max_num_seqs=min(batch, 256),
            seed=self.run.seed,
        )
        try:
            rep = self.engine.refit(export_weights(self.trainer.model))
        except BaseException:
            self.close()
            raise
        self.engine_parity_tensors = rep.parity_compared
        self.log(
            f"vLLM rollout engine started ({self.recipe.name}: {rep.fp8_layers} FP8 linears, "
            f"parity {rep.parity_compared} tensors bit-identical)"
        )

    def close(self) -> None:
        """Shut down the vLLM engine (if any) and revert its patch (idempotent)."""
        if self.engine is not None:
            self.engine.close()

    # -- checkpoint state ----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        kv = None
        if self.kv is not None and self.kv.scales is not None:
            kv = {str(i): dict(per) for i, per in self.kv.scales.layers.items()}
        return {
            "optimizer": self.trainer.optimizer.state_dict(),
            "data_gen": self.data_gen.get_state(),
            "sample_gen": self.sample_gen.get_state(),
            "kv_scales": kv,
            "refit_refused_total": self.refit_refused_total,
            "recipe": self.recipe.name,
        }

    def restore(self, path: Path) -> None:
        master, state = ckpt.load_checkpoint(path)
        if state.get("recipe") not in (None, self.recipe.name):
            raise ConfigError(
                [
                    ConfigIssue(
                        "checkpointing.checkpoint_dir",
                        f"checkpoint {path} was written by recipe {state['recipe']!r}, this run "
                        f"is {self.recipe.name!r}: point --resume at the matching run",
                    )
                ]
            )
        self.trainer.load_master(master)
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.data_gen.set_state(state["data_gen"])
        self.sample_gen.set_state(state["sample_gen"])
        self.refit_refused_total = int(state.get("refit_refused_total", 0))
        if self.kv is not None and state.get("kv_scales"):
            from nemo_jetrl.kvcache import KVScales

            layers = {int(i): per for i, per in state["kv_scales"].items()}
            self.kv.set_scales(KVScales(layers=layers))
            self.kv_calibrated = True
        self.step = int(state["step"])

    def save(self) -> Path | None:
        if not self.run.checkpoint_enabled:
            return None
        return ckpt.save_checkpoint(
            self.run.resolved_checkpoint_dir(),
            self.step,
            self.trainer.master_state(),
            self.state(),
            keep_top_k=self.run.keep_top_k,
        )

    # -- phases --------------------------------------------------------------------------------

    def engine_kv_scales(self) -> dict[int, dict[str, float]] | None:
        """The trainer's calibrated KV scales for the vLLM engine (None: no FP8 KV / not yet).

        A tensor without a calibrated scale gets vLLM's default 1.0, as the trainer assumes."""
        if self.kv is None or self.kv.scales is None:
            return None
        return {
            i: {t: float(per.get(t, 1.0)) for t in ("q", "k", "v")}
            for i, per in self.kv.scales.layers.items()
        }

    def do_refit(self, hooks: Hooks) -> tuple[bool, str | None]:
        weights = export_weights(self.trainer.model)
        if hooks.before_refit is not None:
            weights = hooks.before_refit(self.step + 1, dict(weights))
        try:
            refit(self.rollout_model, weights)
        except RefitRefused as exc:
            self.refit_refused_total += 1
            return False, str(exc)
        if self.engine is not None:
            from nemo_jetrl.vllm_patch.refit import RefitError

            try:  # vLLM's own guards; a ParityError (bits differ) is raised, never swallowed
                rep = self.engine.refit(weights, kv_scales=self.engine_kv_scales())
                self.engine_parity_tensors = rep.parity_compared
                self.engine_kv_layers = rep.kv_layers
            except RefitError as exc:
                self.refit_refused_total += 1
                return False, f"vLLM engine: {exc}"
        return True, None

    def _generate(self, prompt_ids: torch.Tensor, generator: torch.Generator, *, greedy: bool):
        """Rollout on the configured engine (HF model or vLLM)."""
        kw = dict(
            max_new_tokens=self.max_new_tokens,
            temperature=self.run.temperature,
            eos_id=self.tokenizer.eos_token_id,
            pad_id=self.tokenizer.pad_token_id,
            generator=generator,
            greedy=greedy,
        )
        if self.engine is not None:
            return self.engine.generate(prompt_ids, **kw)
        return generate(self.rollout_model, prompt_ids, cache_factory=self._cache_factory(), **kw)

    def _cache_factory(self):
        return self.kv.rollout_cache if self.kv is not None else None

    def validate(self) -> dict[str, float]:
        t0 = time.perf_counter()
        prompts = encode_prompts(self.val_problems, self.tokenizer)
        g = torch.Generator().manual_seed(self.run.seed + 1000 + self.step)
        rb = self._generate(prompts, g, greedy=self.local.val_greedy)
        texts, finished, mask = decode_responses(rb.response_ids, self.tokenizer)
        results = [
            score(p, t, f, self.task)
            for p, t, f in zip(self.val_problems, texts, finished, strict=True)
        ]
        return {
            "validation/accuracy": sum(c for _, c in results) / len(results),
            "validation/avg_reward": sum(r for r, _ in results) / len(results),
            "validation/avg_length": float(mask.sum(1).float().mean()),
            "timing/validation/total_validation_time": time.perf_counter() - t0,
        }

    def train_step(self, hooks: Hooks) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """One GRPO step (see the module docstring); returns (scalars, train-data records)."""
        timing: dict[str, float] = {}
        cpu: dict[str, float] = {}
        s: dict[str, float] = {}

        def phase(name: str, t0: float, c0: float) -> None:
            timing[T + name] = time.perf_counter() - t0
            cpu["jetrl/local/cpu_time/" + name] = time.process_time() - c0

        t_start, c_start = time.perf_counter(), time.process_time()
        # 1. refit
        t0, c0 = time.perf_counter(), time.process_time()
        ok, why = self.do_refit(hooks)
        phase("prepare_for_generation", t0, c0)
        s["jetrl/local/refit_refused"] = 0.0 if ok else 1.0
        if self.engine is not None:
            s["jetrl/local/vllm_parity_tensors"] = float(self.engine_parity_tensors if ok else 0)
        if not ok:
            self.log(f"step {self.step + 1}: {why}")
        # 2. rollout + rewards
        t0, c0 = time.perf_counter(), time.process_time()
        G = self.run.num_generations_per_prompt
        problems = sample_problems(self.run.num_prompts_per_step, self.task, self.data_gen)
        prompt_ids = encode_prompts(problems, self.tokenizer).repeat_interleave(G, dim=0)
        if self.kv is not None and not self.kv_calibrated:
            # first step: no responses yet, so the initial KV scales come from the prompts
            self.kv.calibrate(self.trainer.model, prompt_ids, mask="prompt_and_response")
            self.kv_calibrated = True
            if self.engine is not None:  # the engine's KV cache takes the same scales
                self.engine_kv_layers = self.engine.set_kv_scales(self.engine_kv_scales())
        if self.engine is not None and self.kv is not None:  # layers whose scales this rollout uses
            s["jetrl/local/vllm_kv_layers"] = float(self.engine_kv_layers)
        rb = self._generate(prompt_ids, self.sample_gen, greedy=False)
        phase("generation", t0, c0)
        t0, c0 = time.perf_counter(), time.process_time()
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
        phase("reward_calculation", t0, c0)
        # 3. score
        t0, c0 = time.perf_counter(), time.process_time()
        P = prompt_ids.shape[1]
        ids = torch.cat([prompt_ids, rb.response_ids], dim=1)
        prev = self.trainer.score(ids, P)
        ref = self.trainer.reference_logprobs(ids, P)
        phase("policy_and_reference_logprobs", t0, c0)
        gen = rb.generation_logprobs
        s.update(mismatch_metrics(gen, prev, mask))
        # 4. update
        t0, c0 = time.perf_counter(), time.process_time()
        lm = self.trainer.update(
            ids,
            P,
            prev_logprobs=prev,
            generation_logprobs=gen,
            advantages=adv,
            token_mask=mask,
            reference_logprobs=ref,
        )
        phase("policy_training", t0, c0)
        s.update(lm)
        # 5. KV recalibration on this step's data, with the updated weights
        if self.kv is not None:
            t0, c0 = time.perf_counter(), time.process_time()
            full_mask = torch.cat([torch.ones_like(prompt_ids, dtype=torch.bool), mask], dim=1)
            resp_mask = torch.cat([torch.zeros_like(prompt_ids, dtype=torch.bool), mask], dim=1)
            res = self.kv.calibrate(self.trainer.model, ids, full_mask, resp_mask)
            phase("kv_calibration", t0, c0)
            s["jetrl/local/kv_refused_layers"] = float(len(res.refused))
        self.step += 1
        s["train/reward"] = float(rewards.mean())
        s["train/accuracy"] = sum(c for _, c in scored) / len(scored)
        s["jetrl/local/mean_response_tokens"] = float(mask.sum(1).float().mean())
        s["jetrl/local/frac_finished"] = float(rb.finished.float().mean())
        s["jetrl/local/refit_refused_total"] = float(self.refit_refused_total)
        timing[T + "total_step_time"] = time.perf_counter() - t_start
        cpu["jetrl/local/cpu_time/total_step_time"] = time.process_time() - c_start
        s.update(timing)
        s.update(cpu)
        records = []
        for i in range(ids.shape[0]):
            pad = [0.0] * P
            records.append(
                {
                    "content": texts[i],
                    "token_ids": ids[i].tolist(),
                    "generation_logprobs": pad + gen[i].tolist(),
                    "prev_logprobs": pad + prev[i].tolist(),
                    "token_loss_mask": [0] * P + mask[i].int().tolist(),
                    "sample_loss_mask": 1,
                    "rewards": float(rewards[i]),
                    "advantages": float(adv[i]),
                }
            )
        return s, records


def run_local(
    cfg: DictConfig,
    *,
    resume: bool = False,
    progress: bool = True,
    hooks: Hooks | None = None,
    log=None,
) -> RunResult:
    """Run (or resume) a local GRPO run described by a NeMo-RL-shaped config."""
    from nemo_jetrl.runs.writer import RunWriter

    hooks = hooks or Hooks()
    tqdm_mod = require("tqdm", feature="the training progress bar") if progress else None
    write = (tqdm_mod.tqdm.write if tqdm_mod else print) if log is None else log
    t_begin = time.perf_counter()
    run = LocalRun(cfg, log=write)
    if hooks.on_run is not None:
        hooks.on_run(run)
    rs = run.run
    log_dir = Path(rs.log_dir)
    if resume:
        latest = ckpt.latest_checkpoint(rs.resolved_checkpoint_dir())
        if latest is None:
            write(f"--resume: no checkpoint in {rs.resolved_checkpoint_dir()}; starting fresh")
        else:
            try:
                run.restore(latest)
            except BaseException:
                run.close()  # a vLLM engine must not outlive a failed start
                raise
            write(f"resumed from {latest} (step {run.step})")
    first = run.step
    writer = RunWriter(
        log_dir, config=OmegaConf.to_container(cfg, resolve=True), recipe=run.recipe.name
    )
    history: list[dict[str, float]] = []
    bar = None
    if tqdm_mod is not None:
        bar = tqdm_mod.tqdm(
            total=rs.max_num_steps, initial=run.step, desc=f"{run.recipe.name}", unit="step",
            file=sys.stderr, dynamic_ncols=True,
        )  # fmt: skip
    try:
        if run.step == 0 and rs.val_at_start and rs.val_period:
            writer.log_scalars(0, run.validate())
        while run.step < rs.max_num_steps:
            scalars, records = run.train_step(hooks)
            step = run.step
            if rs.val_period and step % rs.val_period == 0:
                scalars.update(run.validate())
            writer.log_scalars(step, scalars)
            writer.log_train_data(step, records)
            writer.flush()
            if rs.checkpoint_enabled and (step % rs.save_period == 0 or step == rs.max_num_steps):
                t0 = time.perf_counter()
                run.save()
                writer.log_scalars(step, {"timing/train/checkpointing": time.perf_counter() - t0})
            history.append({"step": step, **scalars})
            if hooks.after_step is not None:
                hooks.after_step(step, scalars)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(
                    reward=f"{scalars['train/reward']:.3f}",
                    tmpe=f"{scalars['train/token_mult_prob_error']:.5f}",
                    refresh=False,
                )
            if not all(math.isfinite(v) for k, v in scalars.items() if k.startswith("train/loss")):
                write(f"step {step}: non-finite loss")
    finally:
        if bar is not None:
            bar.close()
        writer.close()
        if run.kv is not None:
            run.kv.detach()
        run.close()
    return RunResult(
        log_dir=log_dir,
        recipe=run.recipe.name,
        first_step=first,
        last_step=run.step,
        history=history,
        seconds=time.perf_counter() - t_begin,
    )
