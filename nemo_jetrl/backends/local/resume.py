"""Checkpointing of a local run: `RunCheckpointing`, the part of `LocalRun` that gathers the
state beyond the weights (optimizer, RNG states, KV scales, refused refits) for
`nemo_jetrl.backends.local.checkpoint`, saves it every ``checkpointing.save_period`` steps and
restores it on ``--resume`` so the resumed steps reproduce an uninterrupted run exactly. The
run id travels in the state so a resumed run's logs carry the id of the run it continues.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_jetrl.backends.local import checkpoint as ckpt
from nemo_jetrl.config.load import ConfigError, ConfigIssue


class RunCheckpointing:
    """Checkpoint state of a run; mixed into `nemo_jetrl.backends.local.setup.LocalRun`."""

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
            "run_id": getattr(self, "run_id", None),
        }

    def restore(self, path: Path, loaded: tuple[dict[str, Any], dict[str, Any]] | None = None):
        """Continue from checkpoint ``path`` (``loaded``: its (master, state), already read
        and verified by `checkpoint.find_resumable`)."""
        master, state = loaded if loaded is not None else ckpt.load_checkpoint(path)
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
        if state.get("run_id"):  # a resumed run keeps its id: its logs are one run
            self.run_id = str(state["run_id"])

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
