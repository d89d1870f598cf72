"""Checkpointing of a local run: `RunCheckpointing`, the part of `LocalRun` that gathers the
state beyond the weights (optimizer, RNG states, KV scales, refused refits) for
`nemo_jetrl.backends.local.checkpoint`, saves it every ``checkpointing.save_period`` steps and
restores it on ``--resume`` so the resumed steps reproduce an uninterrupted run exactly. The
run id travels in the state so a resumed run's logs carry the id of the run it continues; the
recipe and the run's identity (`nemo_jetrl.backends.local.run_identity`: model config, tokenizer,
seed, dtype, task, warm start...) travel too, and `resume_refusal` refuses a config that differs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_jetrl.backends.local import checkpoint as ckpt
from nemo_jetrl.backends.local.run_identity import IDENTITY_KEY, identity_issues, run_identity
from nemo_jetrl.backends.local.trainer import OptimConfig
from nemo_jetrl.config.load import ConfigError, ConfigIssue
from nemo_jetrl.recipe import Recipe, preset_differences

#: The state key of the rollout's last good weights, written while refits are refused.
ROLLOUT_KEY = "rollout_weights"
#: ``policy.optimizer.kwargs`` keys a resumed run takes from its config, not the checkpoint
#: (torch's ``load_state_dict`` restores the saved param groups' values).
OPTIMIZER_KWARGS = ("lr", "betas", "eps", "weight_decay")


def recipe_issue(state: dict[str, Any], recipe: Recipe, path: Path) -> ConfigIssue | None:
    """The issue when checkpoint ``path`` (its ``state``) was written under a recipe whose
    numerics differ from ``recipe``'s (`recipe.preset_differences`: scale mode, FP8 KV, on-policy
    KV...; the name alone for checkpoints written before the whole recipe was saved)."""
    spec = state.get("recipe_spec")
    if spec is not None:
        theirs = Recipe.from_dict(spec)
        changed = [d.split(":")[0] for d in preset_differences(recipe, theirs)]
    else:
        theirs = None
        changed = [] if state.get("recipe") in (None, recipe.name) else ["name"]
    if not changed:
        return None
    name = theirs.name if theirs is not None else state.get("recipe")
    return ConfigIssue(
        "checkpointing.checkpoint_dir",
        f"checkpoint {path} was written by recipe {name!r}, this run is "
        f"{recipe.name!r} (differs in {', '.join(changed)}): resuming would go on from "
        "another recipe's weights; resume with the config that wrote it, or point "
        "checkpointing.checkpoint_dir / logger.log_dir at a new run",
    )


def recipe_refusal(state: dict[str, Any], recipe: Recipe, path: Path) -> None:
    """`ConfigError` with `recipe_issue`, if any."""
    issue = recipe_issue(state, recipe, path)
    if issue is not None:
        raise ConfigError([issue])


def resume_refusal(
    state: dict[str, Any],
    recipe: Recipe,
    identity: dict[str, Any],
    path: Path,
    *,
    log: Callable[[str], None] | None = None,
) -> None:
    """Whether this config may continue checkpoint ``path`` (its ``state``), before any work:
    `ConfigError` listing the recipe's difference (`recipe_issue`) and each changed key of the
    run's identity (`run_identity.identity_issues`; ``identity``: this config's
    `run_identity.run_identity`); else ``log`` gets the notes (a changed `run_identity.NOTED`
    key, keys the checkpoint predates)."""
    issues, notes = identity_issues(state, identity, path)
    recipe_problem = recipe_issue(state, recipe, path)
    if recipe_problem is not None:
        issues.insert(0, recipe_problem)
    if issues:
        raise ConfigError(issues)
    for note in notes if log is not None else ():
        log(f"--resume: {note}")


def apply_optimizer_settings(optimizer: Any, optim: OptimConfig) -> list[str]:
    """Put ``optim``'s `OPTIMIZER_KWARGS` into every param group of a just-loaded ``optimizer``
    (a resubmission that lowers ``lr`` gets it); one message per value that changed."""
    msgs = []
    for key in OPTIMIZER_KWARGS:
        want = tuple(optim.betas) if key == "betas" else getattr(optim, key)
        had = optimizer.param_groups[0][key]
        if (tuple(had) if key == "betas" else had) != want:
            msgs.append(
                f"policy.optimizer.kwargs.{key} {had!r} in the checkpoint, {want!r} in this "
                "config: the config's applies from here on"
            )
        for group in optimizer.param_groups:
            group[key] = want
    return msgs


class RunCheckpointing:
    """Checkpoint state of a run; mixed into `nemo_jetrl.backends.local.setup.LocalRun`."""

    #: `run_identity.run_identity` of this run: `loop.run_local` sets what it read before any
    #: work (the files the run then loaded); else read from the config at the first save.
    identity: dict[str, Any] | None = None

    def identity_record(self) -> dict[str, Any]:
        """What this run's checkpoints record of its identity (`run_identity.IDENTITY_KEY`)."""
        if self.identity is None:
            self.identity = run_identity(self.run, self.local)
        return self.identity

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
            "recipe_spec": self.recipe.to_dict(),
            "run_id": getattr(self, "run_id", None),
            IDENTITY_KEY: self.identity_record(),
            # refits refused since the rollout's last good weights: they travel (a resumed run
            # rolls out from them, as this one does, until a refit is accepted)
            ROLLOUT_KEY: self.rollout_source if self.rollout_stale else None,
        }

    def restore(self, path: Path, loaded: tuple[dict[str, Any], dict[str, Any]] | None = None):
        """Continue from checkpoint ``path`` (``loaded``: its (master, state), already read
        and verified by `checkpoint.find_resumable`)."""
        master, state = loaded if loaded is not None else ckpt.load_checkpoint(path)
        # run_local refused (or noted) this before any work; here for a direct caller
        resume_refusal(state, self.recipe, self.identity_record(), path)
        self.trainer.load_master(master)
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        for msg in apply_optimizer_settings(self.trainer.optimizer, self.trainer.optim_cfg):
            self.log(f"resume: {msg}")
        self.data_gen.set_state(state["data_gen"])
        self.sample_gen.set_state(state["sample_gen"])
        self.refit_refused_total = int(state.get("refit_refused_total", 0))
        if self.kv is not None and state.get("kv_scales"):
            from nemo_jetrl.kvcache import KVScales

            layers = {int(i): per for i, per in state["kv_scales"].items()}
            self.kv.set_scales(KVScales(layers=layers))
            self.kv_calibrated = True
        self.step = int(state["step"])
        self._restore_rollout(state.get(ROLLOUT_KEY), path)
        if state.get("run_id"):  # a resumed run keeps its id: its logs are one run
            self.run_id = str(state["run_id"])

    def _restore_rollout(self, weights: dict[str, Any] | None, path: Path) -> None:
        """Put the rollout back on the last good weights a checkpoint holds (``weights``; None:
        its rollout held the trainer's or the start weights, as a resumed run's does)."""
        if weights is None:
            return
        weights = {k: v.to(self.device) for k, v in weights.items()}  # saved, read on the host
        ok, why = self.load_rollout(weights)
        if not ok:  # they were accepted when this checkpoint was written
            raise RuntimeError(f"--resume: {path}'s rollout weights were refused: {why}")
        self.rollout_source, self.rollout_stale = weights, True
        self.log(
            f"--resume: refits were refused when {path.name} was written; the rollout continues "
            "from the weights of its last accepted refit until one is accepted"
        )

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
