"""Running `jetrl demo`'s GRPO runs: one per (recipe, GRPO seed), on ``--jobs`` processes.

Each run is single-threaded (``jetrl.local.num_threads: 1``: these ops are too small for
threads), so the demo's K seeds x 4 recipes use a machine's cores only as separate processes.
This process first loads or trains the warm start that every run then loads from the cache
(`prepare_warm_start`), so no two processes train it at once; then every run goes to a
spawn-started process pool (never fork: a forked torch/OpenMP runtime can hang), the costliest
recipes first, and reports one line as it finishes; results come back in job order, so the
demo's tables and claims do not depend on which process finished first. With ``--jobs 1`` (or
a vLLM rollout engine, which building a run would start) the first run goes alone in this
process with its progress bar instead, and the rest follow it one by one or on the pool.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Per-run CPU time relative to bf16's (measured, 16 steps, 256-problem validations: bf16 ~4 s,
# fp8_rollout ~8 s, jetrl and jetrl_kv ~10 s): the pool starts the costliest runs first.
RELATIVE_COST = {"bf16": 1.0, "fp8_rollout": 2.0, "jetrl": 2.5, "jetrl_kv": 2.5}


@dataclass(frozen=True)
class Job:
    """One demo run: its recipe, GRPO seed, log dir and full config (the loaded tree the local
    backend's door `run_local` reads; picklable, built by the demo so a bad ``--set`` fails
    before any run)."""

    recipe: str
    seed: int
    run_dir: Path
    cfg: Any


@dataclass(frozen=True)
class Done:
    """What a finished run reports back (picklable)."""

    job: Job
    mismatch: dict
    """float64 mismatch curves (`nemo_jetrl.commands._demo_report.mismatch_curves`)."""
    line: str
    """One human line: steps, time, last reward and accuracy, worst mismatch step."""
    log: tuple[str, ...] = ()
    error: str | None = None
    """A config error's message (the parent turns it into a `UserError`, exit 2)."""


def run_job(job: Job, progress: bool = False, log: Callable[[str], None] | None = None) -> Done:
    """Run one job to completion (in this process); never raises for a config error."""
    from nemo_jetrl.backends.local.loop import resolve_run, run_local
    from nemo_jetrl.commands._demo_report import TMPE, mismatch_curves
    from nemo_jetrl.commands._demo_stats import fmt_ratio
    from nemo_jetrl.config import ConfigError

    lines: list[str] = []
    try:
        res = run_local(resolve_run(job.cfg), progress=progress, log=log or lines.append)
    except ConfigError as exc:
        return Done(job, {}, "", tuple(lines), error=str(exc))
    accs = [h["validation/accuracy"] for h in res.history if "validation/accuracy" in h]
    mismatch = mismatch_curves(job.run_dir)
    tm = mismatch[TMPE][1]
    line = (
        f"{res.last_step} steps in {res.seconds:.1f}s: last reward "
        f"{res.history[-1]['train/reward']:.3f}, last validation accuracy "
        f"{accs[-1] if accs else float('nan'):.3f}, token_mult_prob_error worst step "
        f"{fmt_ratio(max(tm)) if tm else '-'}"
    )
    return Done(job, mismatch, line, tuple(lines))


def _starts_an_engine(job: Job) -> bool:
    from nemo_jetrl.config import settings_of

    return settings_of(job.cfg).local.rollout_engine == "vllm"


def prepare_warm_start(job: Job, log: Callable[[str], None]) -> str | None:
    """Load or train (and cache) the warm start of ``job`` in this process, before any pool
    process needs it: building the run's `LocalRun` does exactly that, through the same cache
    key; the run is closed without a step. Returns a config error's message, else None."""
    from nemo_jetrl.backends.local.setup import LocalRun, resolve_run
    from nemo_jetrl.config import ConfigError

    try:
        LocalRun(resolve_run(job.cfg), log=log).close()
    except ConfigError as exc:
        return str(exc)
    return None


def run_jobs(jobs: list[Job], workers: int, progress: bool) -> list[Done]:
    """Every job (warm start first, see the module docstring); results in job order. Prints one
    line per finished run."""
    from nemo_jetrl.errors import UserError

    def report(i: int, d: Done) -> None:
        for m in d.log:
            print(f"   {m}", flush=True)
        if d.error is not None:
            raise UserError(d.error)
        print(
            f"   [{i + 1}/{len(jobs)}] {d.job.recipe}, GRPO seed {d.job.seed}: {d.line}", flush=True
        )

    t0 = time.perf_counter()
    done: dict[int, Done] = {}
    rest = list(enumerate(jobs))
    if workers <= 1 or _starts_an_engine(jobs[0]):
        print(
            f"== {jobs[0].recipe}, GRPO seed {jobs[0].seed} (loads or trains the warm start)",
            flush=True,
        )
        done[0] = run_job(jobs[0], progress=progress, log=lambda m: print(m, flush=True))
        report(0, done[0])
        rest = rest[1:]
    else:
        print("== the warm start every run shares (loaded, or trained once)", flush=True)
        error = prepare_warm_start(jobs[0], log=lambda m: print(m, flush=True))
        if error is not None:
            raise UserError(error)
    if rest:
        print(f"== {len(rest)} runs on {workers} process(es)", flush=True)
    if workers <= 1:
        for i, job in rest:
            done[i] = run_job(job, progress=progress, log=lambda m: print(m, flush=True))
            report(i, done[i])
    elif rest:
        # the costliest runs first, so the pool does not end on one long run beside an idle CPU
        rest.sort(key=lambda ij: -RELATIVE_COST.get(ij[1].recipe, max(RELATIVE_COST.values())))
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures = {pool.submit(run_job, job): i for i, job in rest}
            for fut in as_completed(futures):
                i = futures[fut]
                done[i] = fut.result()
                report(i, done[i])
    print(f"== {len(jobs)} runs in {time.perf_counter() - t0:.0f}s wall", flush=True)
    return [done[i] for i in range(len(jobs))]
