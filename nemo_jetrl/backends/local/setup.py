"""Setting up a local GRPO run: `resolve_run` reads and checks the config once (every problem at
once; this backend's door; `SECTION` gives `jetrl check` the same rules) into a typed
`ResolvedRun`, and `LocalRun` builds the run's state from that (tokenizer, warm-started weights,
the trainer with its fp32 masters and optional frozen reference, the rollout model under the
recipe's FP8 layers, the FP8 KV controller, the MoE routing controller, generators) and starts or
closes the vLLM rollout engine. Its step phases come from
`nemo_jetrl.backends.local.step`, its checkpointing from `nemo_jetrl.backends.local.resume`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from nemo_jetrl.backends.local.bf16_gemm import invariant_linears, swap_bf16_linears
from nemo_jetrl.backends.local.config import (
    LocalSettings,
    RunSettings,
    local_model_config,
    validate_local_config,
    validate_local_run,
)
from nemo_jetrl.backends.local.device import device_issues, make_current
from nemo_jetrl.backends.local.model import build_model, load_model_config
from nemo_jetrl.backends.local.moe_config import (
    moe_run_issues,
    replay_unrecordable,
    router_replay_enabled,
)
from nemo_jetrl.backends.local.precision import (
    freeze,
    make_rollout_model,
    make_trainer_model,
    model_dtype,
)
from nemo_jetrl.backends.local.refit import export_weights
from nemo_jetrl.backends.local.resume import RunCheckpointing
from nemo_jetrl.backends.local.routing import RoutingController
from nemo_jetrl.backends.local.run_identity import tokenizer_path
from nemo_jetrl.backends.local.seq_len import (
    MEASURE_READS,
    SequenceLengths,
    data_generator,
    measure,
)
from nemo_jetrl.backends.local.step import RunStep
from nemo_jetrl.backends.local.task import validation_problems
from nemo_jetrl.backends.local.tokenizer import load_tokenizer
from nemo_jetrl.backends.local.trainer import OptimConfig, Trainer
from nemo_jetrl.backends.local.warmstart import load_or_train
from nemo_jetrl.config.load import ConfigError, ConfigIssue, config_yaml
from nemo_jetrl.config.run_keys import read_run_keys
from nemo_jetrl.config.sections import BackendSection
from nemo_jetrl.config.settings import Settings, settings_of
from nemo_jetrl.invariant import make_batch_invariant
from nemo_jetrl.recipe import Recipe
from nemo_jetrl.rl.loss_config import GRPOLossConfig


def _loss_config(cfg: DictConfig) -> GRPOLossConfig:
    from nemo_jetrl.rl.correction import CorrectionConfigError

    section = OmegaConf.select(cfg, "loss_fn", default=None)
    if section is None:
        return GRPOLossConfig(reference_policy_kl_penalty=0.0)
    try:
        return GRPOLossConfig.from_loss_fn_cfg(OmegaConf.to_container(section, resolve=True))
    except CorrectionConfigError as exc:
        raise ConfigError([ConfigIssue("loss_fn", e) for e in exc.errors]) from None


def check_issues(section: Any, keys: Mapping[str, Any], settings: Settings) -> list[ConfigIssue]:
    """What `resolve_run` refuses on ``jetrl.local`` and the run keys together, for `jetrl check`
    (`SECTION.validate_with_run`): the sequence lengths (`seq_len.measure`), same keys and text.
    ``keys``: the run keys as `read_run_keys` typed them; nothing when either side does not
    parse (the validator names why, and the door stops there too)."""
    run = RunSettings(**keys)  # not from_keys: the optimizer's problem must not hide this rule
    try:
        local = LocalSettings.from_cfg(section)
    except ConfigError:
        return []
    # a model config that does not load: the validator's architecture check reads that file
    # (`local_model_config`) and names why; the tokenizer only this rule loads
    return [i for i in measure(run, local)[1] if i.path != "jetrl.local.model_config"]


SECTION = BackendSection(
    validate=validate_local_config,
    validate_run=validate_local_run,
    model_config=local_model_config,
    validate_with_run=check_issues,
    with_run_reads=MEASURE_READS,
)
"""This backend's hooks for ``jetrl.local`` (`nemo_jetrl.config.sections`)."""


def _run_settings(cfg: DictConfig, settings: Settings) -> RunSettings:
    found: list[ConfigIssue] = []
    return RunSettings.from_keys(read_run_keys(cfg, found), found, settings)


@dataclasses.dataclass(frozen=True)
class ResolvedRun:
    """Everything a local run reads from its config, typed, read once by `resolve_run`."""

    recipe: Recipe
    run: RunSettings  # NeMo-RL's grpo/policy/logger/checkpointing keys this run uses
    local: LocalSettings  # jetrl.local
    loss: GRPOLossConfig  # loss_fn
    settings: Settings  # the config's typed settings (MoE routing replay, ...)
    config_yaml: str  # config.yaml as written: interpolations unresolved, jetrl.recipe set
    lengths: SequenceLengths  # longest prompt, max_new_tokens, the model's positions (seq_len)


def resolve_run(cfg: DictConfig, *, recipe: Recipe | None = None) -> ResolvedRun:
    """What a local run needs, read from the tree once here (the local backend's door);
    `ConfigError` listing every problem. ``recipe``: the one the caller's validation
    (`flow.pipeline.check_config`) already built from this tree, not validated again."""
    from nemo_jetrl.config import recipe_from_config

    settings = settings_of(cfg)
    issues: list[ConfigIssue] = []
    out: list[Any] = []
    checks = (
        lambda: recipe if recipe is not None else recipe_from_config(cfg),
        lambda: _run_settings(cfg, settings),
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
    recipe, run, local = out[0], out[1], out[2]
    issues.extend(moe_run_issues(settings))
    lengths = None
    if run is not None and local is not None:  # prompt + max_new_tokens past the model's positions
        lengths, found = measure(run, local)
        issues.extend(found)
    if local is not None:  # before any work: a CUDA device this machine lacks (exit 2)
        issues.extend(device_issues(local.device))
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
    text = config_yaml(cfg, recipe=recipe.name)
    return ResolvedRun(*out, settings=settings, config_yaml=text, lengths=lengths)


class LocalRun(RunStep, RunCheckpointing):
    """All state of one local GRPO run (models, trainer, generators, KV controller, writer);
    the step phases come from `RunStep`, the checkpoint state from `RunCheckpointing`."""

    def __init__(self, resolved: ResolvedRun, *, log=print) -> None:
        """``resolved``: the run's config as `resolve_run` read it."""
        if not isinstance(resolved, ResolvedRun):  # the tree itself, as LocalRun took it before
            raise TypeError(
                f"LocalRun takes the ResolvedRun of a config, got {type(resolved).__name__}: "
                "call LocalRun(resolve_run(cfg))"
            )
        self.resolved = resolved
        self.log = log
        self.recipe, self.run, self.local = resolved.recipe, resolved.run, resolved.local
        loss_cfg = resolved.loss
        self.run_id: str | None = None  # set by run_local; kept across --resume
        self._set_num_threads()
        self.device = torch.device(self.local.device)
        make_current(self.device)
        self.tokenizer = load_tokenizer(self.local.tokenizer)
        self.model_config = load_model_config(self.local.model_config)
        self.task = self.local.task
        dtype = model_dtype(self.local.dtype)
        weights = self._initial_weights()
        train_model = self._build_trainer(weights, loss_cfg, dtype)
        self._build_rollout_model(train_model, dtype)
        self._attach_kv_cache(train_model)
        self.routing = RoutingController(
            self.rollout_model, train_model, replay=router_replay_enabled(resolved.settings)
        )
        seed = self.run.seed
        # CPU generators on every device: rollout.sample draws on the CPU, so the checkpointed
        # generator states and the draws given the same probabilities do not depend on the device
        self.data_gen = data_generator(seed)
        self.sample_gen = torch.Generator().manual_seed(seed + 3)
        self.val_problems = validation_problems(self.task, seed)
        self.max_new_tokens = resolved.lengths.max_new_tokens
        self.step = 0
        self.refit_refused_total = 0
        self.kv_calibrated = False
        if self.local.rollout_engine == "vllm":
            self._start_engine()

    def _set_num_threads(self) -> None:
        """Apply ``jetrl.local.num_threads`` (if set), warning when it exceeds the CPU count."""
        if not self.local.num_threads:
            return
        cpus = os.cpu_count() or 1
        if self.local.num_threads > cpus:
            print(
                f"[jetrl] warning: jetrl.local.num_threads={self.local.num_threads} exceeds "
                f"this machine's {cpus} CPUs (threads will contend; 1 is fastest for these "
                "tiny models)",
                flush=True,
            )
        torch.set_num_threads(self.local.num_threads)

    def _initial_weights(self) -> dict[str, torch.Tensor]:
        """The starting state dict: warm-started (trained or loaded from the cache) when
        ``jetrl.local.warmstart`` asks for steps, else the seeded random init; records
        ``warmstart_path`` / ``warmstart_cached``."""
        seed = self.run.seed
        if self.local.warmstart.enabled and self.local.warmstart.steps > 0:
            tok_path = tokenizer_path(self.local)  # run_identity: one home for the rule
            weights, path, cached = load_or_train(
                self.model_config,
                self.tokenizer,
                tok_path.read_text(),
                self.task,
                self.local.warmstart,
                seed,
                self.local.resolved_cache_dir(),
                log=self.log,
            )
            self.warmstart_path: Path | None = path
            self.warmstart_cached = cached
            return weights
        self.warmstart_path, self.warmstart_cached = None, False
        return build_model(self.model_config, seed=seed).state_dict()

    def _build_trainer(
        self, weights: dict[str, torch.Tensor], loss_cfg: GRPOLossConfig, dtype: torch.dtype
    ) -> torch.nn.Module:
        """The trainer side: the training model under the recipe's FP8 plan, its `Trainer`
        (fp32 masters loaded from ``weights``) and, with a KL penalty, a frozen reference copy
        of the same weights. Returns the training model."""
        train_model = build_model(self.model_config, dtype=dtype, seed=self.run.seed)
        train_model.to(self.device)  # before the FP8 swap: its layers are built on the device
        invariant = self.local.batch_invariant
        self.train_plan = make_trainer_model(train_model, self.recipe, exact_gemm=invariant)
        train_model.to(self.device)  # what the swap made on the host (MoE expert stacks)
        if invariant:
            make_batch_invariant(train_model, linear_filter=invariant_linears(self.device))
        swap_bf16_linears(train_model)  # after the invariant swap: lm_head stays invariant
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
        return train_model

    def _build_rollout_model(self, train_model: torch.nn.Module, dtype: torch.dtype) -> None:
        """The rollout side: same class, config and weights as ``train_model``, FP8 layers as
        the rollout recipe says, frozen; no vLLM engine yet (`_start_engine`)."""
        rollout_model = build_model(self.model_config, dtype=dtype, seed=self.run.seed)
        rollout_model.to(self.device)
        rollout_model.load_state_dict(train_model.state_dict(), strict=True)
        invariant = self.local.batch_invariant
        self.rollout_plan = make_rollout_model(rollout_model, self.recipe, exact_gemm=invariant)
        rollout_model.to(self.device)  # Fp8InferenceLinear makes its FP8 buffers on the host
        if invariant:
            make_batch_invariant(rollout_model, linear_filter=invariant_linears(self.device))
        swap_bf16_linears(rollout_model)
        self.rollout_model = freeze(rollout_model)
        self.engine = None  # a VllmRollout with rollout_engine=vllm
        self.engine_parity_tensors = 0
        self.engine_kv_layers = 0

    def _attach_kv_cache(self, train_model: torch.nn.Module) -> None:
        """With an FP8 KV cache recipe, attach one `KVCacheController` to the rollout and the
        training model; ``self.kv`` stays None otherwise."""
        self.kv = None
        if not self.recipe.kv_fp8:
            return
        from nemo_jetrl.kvcache import CalibrationSettings, rollout_cache_kernel
        from nemo_jetrl.kvcache.hf import KVCacheController

        # the local vLLM engine is vLLM's CPU build: its cache writer truncates, and the trainer's
        # K/V must carry the bytes it stores
        self.kv = KVCacheController(
            CalibrationSettings.from_recipe(self.recipe.kv_calibration),
            kernel=rollout_cache_kernel(self.local.rollout_engine, "cpu"),
        )
        self.kv.attach(self.rollout_model, role="rollout")
        self.kv.attach(train_model, role="train", onpolicy=self.recipe.onpolicy_kv)

    def _start_engine(self) -> None:
        """Start the vLLM engine on a run-local model dir and load the trainer's weights."""
        from nemo_jetrl.backends.local.vllm_rollout import VllmRollout

        batch = max(self.run.batch_size, len(self.val_problems))
        self.engine = VllmRollout(
            self.rollout_model,
            self.tokenizer,
            self.recipe,
            Path(self.run.log_dir) / "vllm_model",
            # every prompt of both datasets + max_new_tokens (<= max_position_embeddings: the
            # config was refused otherwise), so vLLM never refuses a prompt nor cuts a response
            max_model_len=self.resolved.lengths.longest_sequence,
            max_num_seqs=min(batch, 256),
            seed=self.run.seed,
            moe_layers=[b.layer for b in self.routing.train_blocks],
            top_k=self.routing.train_blocks[0].top_k if self.routing.active else 0,
        )
        if self.routing.active:
            self.routing.use_engine(self.engine.routing_unavailable)
            if self.engine.routing_unavailable is not None and self.routing.replay:
                why = self.engine.routing_unavailable
                self.close()
                raise ConfigError([replay_unrecordable(why)])
            if self.engine.routing_unavailable is not None:
                self.log(
                    "jetrl/moe/routing_mismatch not logged: the vLLM engine's routing cannot "
                    f"be recorded ({self.engine.routing_unavailable})"
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
