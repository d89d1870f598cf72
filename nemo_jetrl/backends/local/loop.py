"""The local GRPO loop: refit, rollout, score, metrics, update (and KV recalibration) every step.

`run_local` builds a `LocalRun` from the `ResolvedRun` that `resolve_run` read from the config
(`nemo_jetrl.backends.local.setup`: models, trainer, KV controller, vLLM engine start/close) and
runs its steps: the phases of DESIGN.md ("One RL step"), timed with NeMo-RL's timing names, are
in `nemo_jetrl.backends.local.step`, the checkpoint state in `nemo_jetrl.backends.local.resume`. `LocalRun`, `Hooks`, `ResolvedRun` and
`resolve_run` are importable from here too.

Logs go to ``logger.log_dir`` in NeMo-RL's layout through `nemo_jetrl.runs.writer.RunWriter`;
validation accuracy every ``grpo.val_period`` steps; a checkpoint every
``checkpointing.save_period`` steps; ``resume=True`` continues from the latest checkpoint with
the same weights, optimizer state, RNG states and KV scales, so the resumed steps reproduce an
uninterrupted run exactly; a config whose recipe or run identity (model config, tokenizer, seed,
dtype, task, warm start: `nemo_jetrl.backends.local.run_identity`) differs from the
checkpoint's is refused before any work.
"""

from __future__ import annotations

import math
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from nemo_jetrl._optional import require
from nemo_jetrl.backends.local import checkpoint as ckpt
from nemo_jetrl.backends.local.config import RunSettings
from nemo_jetrl.backends.local.resume import resume_refusal
from nemo_jetrl.backends.local.run_identity import run_identity
from nemo_jetrl.backends.local.setup import LocalRun, ResolvedRun, resolve_run
from nemo_jetrl.backends.local.step import Hooks
from nemo_jetrl.errors import UserError
from nemo_jetrl.runs.lock import RunDirLock
from nemo_jetrl.runs.logs import CONFIG_FILE, read_config, run_ids, train_data_files
from nemo_jetrl.runs.tensorboard import find_event_files

__all__ = ["Hooks", "LocalRun", "ResolvedRun", "RunResult", "resolve_run", "run_local"]


@dataclass
class RunResult:
    """What `run_local` did."""

    log_dir: Path
    recipe: str
    first_step: int
    last_step: int
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0


def run_local(
    resolved: ResolvedRun,
    *,
    resume: bool = False,
    progress: bool = True,
    hooks: Hooks | None = None,
    log=None,
) -> RunResult:
    """Run (or resume) the local GRPO run that `resolve_run` read from a NeMo-RL-shaped config
    (this backend's door: ``run_local(resolve_run(cfg))``); its config.yaml is the config as given.

    The run owns ``logger.log_dir`` and ``checkpointing.checkpoint_dir`` for its lifetime
    (`nemo_jetrl.runs.lock`); `UserError` (exit 2) when another live run holds them, when a
    directory cannot be created, or when a fresh start would mix with another run's logs or
    checkpoints.
    """
    if not isinstance(resolved, ResolvedRun):  # the tree itself, as run_local took it before
        raise TypeError(
            f"run_local takes the ResolvedRun of a config, got {type(resolved).__name__}: "
            "call run_local(resolve_run(cfg)) (resolve_run reports every config problem at once)"
        )
    hooks = hooks or Hooks()
    tqdm_mod = require("tqdm", feature="the training progress bar") if progress else None
    write = (tqdm_mod.tqdm.write if tqdm_mod else print) if log is None else log
    t_begin = time.perf_counter()
    rs = resolved.run
    lock = _own_run_dirs(rs, resume=resume, log=write)
    try:
        found, run_id, purge = None, lock.run_id, None
        identity = run_identity(rs, resolved.local)  # the files the run is about to load
        if resume:  # before any work: a damaged checkpoint dir fails here, not after setup
            found = ckpt.find_resumable(rs.resolved_checkpoint_dir(), log=write)
            if found is not None:  # another recipe, model, seed, task...: exit 2 here
                resume_refusal(found[2], resolved.recipe, identity, found[0], log=write)
                purge = int(found[2]["step"]) + 1
            else:
                run_id, purge = _restart_of(rs, lock.run_id, write)
        started = (run_id, identity, found)
        return _run_owned(resolved, started, purge, hooks, tqdm_mod, write, t_begin)
    except ckpt.CheckpointError as exc:
        raise UserError(str(exc)) from None
    finally:
        lock.release()


def _restart_of(rs: RunSettings, run_id: str, write) -> tuple[str, int | None]:
    """``--resume`` with no checkpoint: (run id, purge step) of a fresh start. Over the logs of
    a run killed before its first save (a job script that always passes --resume), the same
    run restarts from step 0: its id kept, every logged step purged (`RunWriter`), so the
    directory holds one run. `UserError` instead over a run that finished or saved its
    checkpoints elsewhere (`_not_restartable`), and over logs of several runs or of one that
    did not name itself."""
    ckpt_dir = rs.resolved_checkpoint_dir()
    earlier = _earlier_run_files(Path(rs.log_dir))
    if not earlier:
        write(f"--resume: no checkpoint in {ckpt_dir}; starting fresh")
        return run_id, None
    ids = run_ids(rs.log_dir)
    if len(ids) == 1 and (why := _not_restartable(rs)):
        raise UserError(
            f"--resume: no checkpoint in {ckpt_dir}, but logger.log_dir {rs.log_dir} holds run "
            f"{ids[0]}, which {why}: restarting it would hide all it logged. Point "
            "checkpointing.checkpoint_dir at its checkpoints, or choose another logger.log_dir "
            "(or remove those logs) to start over"
        )
    if len(ids) != 1:
        whose = f"{len(ids)} runs" if ids else "a writer that did not name its run"
        raise UserError(
            f"--resume: no checkpoint in {ckpt_dir}, and logger.log_dir {rs.log_dir} holds "
            f"the logs of {whose} ({', '.join(earlier)}): starting over there would mix them. "
            "Choose another logger.log_dir or remove those files"
        )
    write(
        f"--resume: no checkpoint in {ckpt_dir}; restarting run {ids[0]} from step 0 in "
        f"{rs.log_dir} (what it logged is replaced)"
    )
    return ids[0], 0


def _own_run_dirs(rs: RunSettings, *, resume: bool, log) -> RunDirLock:
    """Lock the run's directories (exit 2 if another live run holds them), clean what a killed
    save left, and refuse a fresh start over another run's checkpoints."""
    dirs = [("logger.log_dir", Path(rs.log_dir))]
    ckpt_dir = rs.resolved_checkpoint_dir()
    if rs.checkpoint_enabled:
        dirs.append(("checkpointing.checkpoint_dir", ckpt_dir))
    lock = RunDirLock(uuid.uuid4().hex[:12]).acquire(dirs, log=log)
    earlier = [] if resume else _earlier_run_files(Path(rs.log_dir))
    if earlier:
        lock.abandon()  # the directories it made go too
        raise UserError(
            f"logger.log_dir {rs.log_dir} already holds an earlier run ({', '.join(earlier)}): a "
            "fresh run would replace its config.yaml and train data and mix its TensorBoard "
            "events. Choose another logger.log_dir, remove those files, or pass --resume to "
            "continue that run"
        )
    if not rs.checkpoint_enabled:
        return lock
    for msg in ckpt.clean_orphans(ckpt_dir):
        log(msg)
    old = ckpt.list_checkpoints(ckpt_dir)  # a damaged one is an earlier run's too
    if old and not resume:
        lock.abandon()  # the directories it made go too
        raise UserError(
            f"checkpointing.checkpoint_dir {ckpt_dir} already holds checkpoints of an earlier "
            f"run ({', '.join(d.name for _, d in old)}): pass --resume to continue it, or "
            "remove them or choose another logger.log_dir / checkpointing.checkpoint_dir"
        )
    return lock


def _earlier_run_files(log_dir: Path) -> list[str]:
    """What an earlier run left in ``log_dir`` (events, config.yaml, train data), in words."""
    found = []
    if find_event_files(log_dir):
        found.append("TensorBoard events")
    if (log_dir / CONFIG_FILE).exists():
        found.append(CONFIG_FILE)
    if n := len(list(log_dir.glob("train_data_step*.jsonl"))):
        found.append(f"{n} train_data_step*.jsonl")
    return found


def _not_restartable(rs: RunSettings) -> str:
    """Why the run logged in ``rs.log_dir`` is no run killed before its first save ("" when it
    may be): it finished (``grpo.max_num_steps`` logged), or logged a step its config.yaml
    checkpointed, so its checkpoints exist elsewhere (a changed checkpointing.checkpoint_dir)."""
    cfg, _ = read_config(rs.log_dir)
    last = max(train_data_files(rs.log_dir), default=0)
    if last >= rs.max_num_steps:
        return f"logged {last} steps (grpo.max_num_steps={rs.max_num_steps}: it finished)"
    ck = (cfg or {}).get("checkpointing") or {}
    period = ck.get("save_period")
    if ck.get("enabled") and isinstance(period, int) and 1 <= period <= last:
        where = ck.get("checkpoint_dir") or "<logger.log_dir>/checkpoints"
        return (
            f"logged {last} steps saving every {period} (its checkpointing.checkpoint_dir: {where})"
        )
    return ""


def _run_owned(resolved, started, purge, hooks, tqdm_mod, write, t_begin) -> RunResult:
    """The run itself, in directories this process owns; ``started``: (run id, its
    `run_identity`, the verified checkpoint to continue from (`checkpoint.find_resumable`) or
    None); ``purge``: the first step whose earlier logs this run replaces (`RunWriter`'s
    ``purge_step``), or None."""
    run = _start_run(resolved, started, hooks, write)
    rs = run.run
    first = run.step
    if rs.global_batch_note():
        write(f"note: {rs.global_batch_note()}")
    writer = _open_writer(run, purge_step=purge)
    if writer.superseded:
        write(f"moved the replaced steps' train data to {writer.superseded[0].parent}")
    history: list[dict[str, float]] = []
    bar = _progress_bar(tqdm_mod, run)
    try:
        if run.step == 0 and rs.val_at_start and rs.val_period:
            writer.log_scalars(0, run.validate(hooks))
        while run.step < rs.max_num_steps:
            step, scalars = _logged_step(run, writer, hooks)
            history.append({"step": step, **scalars})
            _after_step(step, scalars, hooks, bar, write)
    finally:
        if bar is not None:
            bar.close()
        writer.close()
        if run.kv is not None:
            run.kv.detach()
        run.close()
    return RunResult(
        log_dir=Path(rs.log_dir),
        recipe=run.recipe.name,
        first_step=first,
        last_step=run.step,
        history=history,
        seconds=time.perf_counter() - t_begin,
    )


def _start_run(resolved, started, hooks, write) -> LocalRun:
    """Build the `LocalRun`, call ``hooks.on_run`` and restore ``found`` (if any), closing the
    run (its vLLM engine) when the restore fails."""
    run_id, identity, found = started
    run = LocalRun(resolved, log=write)
    run.run_id, run.identity = run_id, identity
    if hooks.on_run is not None:
        hooks.on_run(run)
    if found is not None:
        try:
            run.restore(found[0], loaded=found[1:])
        except BaseException:
            run.close()  # a vLLM engine must not outlive a failed start
            raise
        write(f"resumed from {found[0]} (step {run.step}, run {run.run_id})")
    return run


def _open_writer(run: LocalRun, *, purge_step: int | None):
    """The run's `RunWriter` on ``logger.log_dir``; a resumed run purges the TensorBoard
    events after its restored step (a restart over a run without checkpoint: all of them)."""
    from nemo_jetrl.runs.writer import RunWriter

    return RunWriter(
        Path(run.run.log_dir),
        config=run.resolved.config_yaml,  # unresolved: secrets stay ${oc.env:...}
        recipe=run.recipe.name,
        run_id=run.run_id,
        purge_step=purge_step,
    )


def _progress_bar(tqdm_mod, run: LocalRun):
    """A tqdm bar over ``grpo.max_num_steps`` starting at the run's step; None without tqdm."""
    if tqdm_mod is None:
        return None
    return tqdm_mod.tqdm(
        total=run.run.max_num_steps, initial=run.step, desc=f"{run.recipe.name}", unit="step",
        file=sys.stderr, dynamic_ncols=True,
    )  # fmt: skip


def _logged_step(run: LocalRun, writer, hooks: Hooks) -> tuple[int, dict[str, float]]:
    """One training step with its validation (every ``grpo.val_period`` steps), logs and
    checkpoint (every ``checkpointing.save_period`` steps and at the last); the step reached
    and its scalars."""
    rs = run.run
    scalars, records = run.train_step(hooks)
    step = run.step
    if rs.val_period and step % rs.val_period == 0:
        scalars.update(run.validate(hooks))
    writer.log_scalars(step, scalars)
    writer.log_train_data(step, records)
    writer.flush()
    if rs.checkpoint_enabled and (step % rs.save_period == 0 or step == rs.max_num_steps):
        t0 = time.perf_counter()
        run.save()
        writer.log_scalars(step, {"timing/train/checkpointing": time.perf_counter() - t0})
    return step, scalars


def _after_step(step: int, scalars: dict[str, float], hooks: Hooks, bar, write) -> None:
    """Report a finished step: ``hooks.after_step``, the progress bar, a non-finite loss."""
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
