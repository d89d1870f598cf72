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

Before any of it the demo checks every run's config (`checked_config`) and claims the run
directories (`claim_run_dirs`: it replaces only directories an earlier demo made, marked by
`DEMO_MARK`). Ctrl-C stops every run: the pool's processes ignore SIGINT, this process cancels
what has not started and terminates the rest, then raises `Interrupted` naming what finished
and what was cut.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_jetrl.errors import UserError

# Per-run CPU time relative to bf16's (measured, 16 steps, 256-problem validations: bf16 ~4 s,
# fp8_rollout ~8 s, jetrl and jetrl_kv ~10 s): the pool starts the costliest runs first.
RELATIVE_COST = {"bf16": 1.0, "fp8_rollout": 2.0, "jetrl": 2.5, "jetrl_kv": 2.5}
# In every run directory a demo made: the next demo may replace it (and nothing else).
DEMO_MARK = ".jetrl-demo"
STOP_WAIT_S = 10  # how long a terminated run process gets before it is killed


class Interrupted(Exception):
    """Ctrl-C stopped the runs; the message says which finished and which were cut."""


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


def checked_config(build: Callable[..., Any], *args: Any) -> tuple[Any, list[str]]:
    """``build(*args)`` and the local backend's full check of it (`resolve_run`, what a run
    reads first): (the config or None, every error in it as one line each)."""
    from nemo_jetrl.backends.local.loop import resolve_run
    from nemo_jetrl.config import ConfigError

    try:
        cfg = build(*args)
        resolve_run(cfg)
    except ConfigError as exc:
        return None, [str(i) for i in exc.issues if i.level == "error"] or [str(exc)]
    return cfg, []


def claim_run_dirs(out: Path, run_dirs: list[Path]) -> None:
    """Make each run directory fresh: one an earlier demo made (`DEMO_MARK`) is replaced whole;
    anything else already there (a file, a directory with content the demo did not make)
    refuses the demo, all named at once (`UserError`) before anything is deleted."""
    foreign = []
    for d in run_dirs:
        for p in [*reversed(d.relative_to(out).parents), d.relative_to(out)][1:]:
            path = out / p
            if path.is_symlink() or (path.exists() and not path.is_dir()):
                foreign.append(f"{path} (not a directory)")
                break
        else:
            if d.is_dir() and not (d / DEMO_MARK).exists() and any(d.iterdir()):
                names = sorted(c.name for c in d.iterdir())
                more = f", ... ({len(names)} entries)" if len(names) > 3 else ""
                foreign.append(f"{d} ({', '.join(names[:3])}{more})")
    if foreign:
        raise UserError(
            f"--out {out}: the demo writes its runs to OUT/runs/<recipe>/..., where it found what "
            f"no demo made: {'; '.join(dict.fromkeys(foreign))}. Move it away or choose another "
            "--out (the demo replaces only run directories a demo made)"
        )
    for d in run_dirs:
        if (d / DEMO_MARK).exists():
            shutil.rmtree(d)  # a demo run always starts fresh
        d.mkdir(parents=True, exist_ok=True)
        (d / DEMO_MARK).write_text(
            "made by jetrl demo: the next demo into this --out replaces it\n"
        )


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
    line per finished run; `Interrupted` on Ctrl-C, every run stopped."""
    done: dict[int, Done] = {}
    try:
        _run_all(jobs, workers, progress, done)
    except KeyboardInterrupt:
        raise Interrupted(_cut_line(jobs, done)) from None
    return [done[i] for i in range(len(jobs))]


def _cut_line(jobs: list[Job], done: dict[int, Done]) -> str:
    name = lambda j: f"{j.recipe}/seed-{j.seed}"  # noqa: E731
    fin = [name(j) for i, j in enumerate(jobs) if i in done]
    cut = [name(j) for i, j in enumerate(jobs) if i not in done]
    return (
        f"{len(fin)} of {len(jobs)} runs finished ({', '.join(fin) or 'none'}); "
        f"cut: {', '.join(cut)}"
    )


def _run_all(jobs: list[Job], workers: int, progress: bool, done: dict[int, Done]) -> None:
    def report(i: int, d: Done) -> None:
        for m in d.log:
            print(f"   {m}", flush=True)
        if d.error is not None:
            raise UserError(d.error)
        print(
            f"   [{i + 1}/{len(jobs)}] {d.job.recipe}, GRPO seed {d.job.seed}: {d.line}", flush=True
        )

    t0 = time.perf_counter()
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
        _run_pool(rest, workers, done, report)
    print(f"== {len(jobs)} runs in {time.perf_counter() - t0:.0f}s wall", flush=True)


def _run_pool(rest: list[tuple[int, Job]], workers: int, done: dict[int, Done], report) -> None:
    """``rest`` on ``workers`` spawned processes. On any exception (Ctrl-C included) nothing
    queued starts and every run process is stopped before it propagates: a plain
    ``with ProcessPoolExecutor`` would wait for every queued run to finish first."""
    ctx = multiprocessing.get_context("spawn")
    before = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_ignore_sigint)
    try:
        # The run processes never see Ctrl-C, not even while they start up (no traceback of a
        # KeyboardInterrupt from them): this process stops them.
        with _sigint_blocked():
            futures = {pool.submit(run_job, job): i for i, job in rest}
        for fut in as_completed(futures):
            i = futures[fut]
            done[i] = fut.result()
            report(i, done[i])
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        procs = [p for p in multiprocessing.active_children() if p not in before]
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(STOP_WAIT_S)
            if p.is_alive():
                p.kill()
                p.join()
        raise
    pool.shutdown()


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked for this thread inside: a process forked here starts with it blocked
    (then ignores it, `_ignore_sigint`); a Ctrl-C that came meanwhile arrives on the way out."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def curves_of(runs: list[Done], logged: list) -> list:
    """`RecipeCurves` per finished run (`_demo_runs.Done`): accuracy and reward as logged,
    mismatch in float64."""
    from nemo_jetrl.commands._demo_report import ACC, REWARD, RecipeCurves

    by_path = {Path(r.path).resolve(): r for r in logged}
    out = []
    for d in runs:
        data = by_path[d.job.run_dir.resolve()]
        curves = {
            tag: (tuple(int(x) for x in s.steps), tuple(s.values))
            for tag, s in data.scalars.items()
            if tag in (ACC, REWARD)
        }
        curves.update(d.mismatch)
        out.append(RecipeCurves(d.job.recipe, curves, seed=d.job.seed))
    return out


def cpu_seconds() -> float:
    """CPU time of this process and its finished child processes (the pool's runs)."""
    import resource

    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ch.ru_utime + ch.ru_stime
