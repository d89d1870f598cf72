"""Fault injection on local runs (issue 17), the run directory: one live run per directory (a
second run exits 2 naming the holder, a killed holder's stale lock is taken over, a fresh run
into an earlier run's directory is refused), ``kill -9`` during a checkpoint save then
``--resume`` (torn checkpoints and other resumes: test_faults_resume.py). Real subprocesses,
real kills, real files; sizes are the shared tiny configs (tests/local_configs.py);
subprocesses use one thread. Bad updates, bad output paths and config.yaml:
tests/runs/test_faults_updates_paths.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import fault_warm_cache
from fault_warm_cache import RECIPE
from local_configs import EXAMPLES, REPO, TINY_OVERRIDES, tiny_cfg

from nemo_jetrl.backends.local import checkpoint as ckpt
from nemo_jetrl.backends.local.loop import Hooks, resolve_run, run_local
from nemo_jetrl.errors import UserError
from nemo_jetrl.runs.lock import LOCK_FILE, RunDirBusy, RunDirLock

TESTS = Path(__file__).resolve().parents[1]
cache_dir = fault_warm_cache.cache_dir  # the module-scoped warm-start cache (a fixture)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


# A real `run_local` in a child process; MODE picks where it stops to wait (for the parent to
# signal it or kill it): "on_run" (directories owned, before step 1) or "save3" (inside the
# step-3 checkpoint save, after its files are written and before the rename).
CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from local_configs import tiny_cfg
    from nemo_jetrl.backends.local import checkpoint as ckpt
    from nemo_jetrl.backends.local.loop import Hooks, resolve_run, run_local

    recipe, log_dir, cache, mode, marker, go, *extra = sys.argv[1:]

    def wait():
        Path(marker).write_text("ready")
        t0 = time.time()
        while not Path(go).exists() and time.time() - t0 < 300:
            time.sleep(0.05)

    hooks = Hooks()
    if mode == "on_run":
        hooks.on_run = lambda run: wait()
    elif mode == "save3":
        real = ckpt._check_files

        def check(d):
            if d.name.startswith(".step_3.tmp-"):
                wait()
            return real(d)

        ckpt._check_files = check
    run_local(resolve_run(tiny_cfg(recipe, Path(log_dir), Path(cache), *extra)), hooks=hooks, progress=False)
    """
)


def _child(tmp: Path, log_dir: Path, cache: Path, mode: str, *extra: str):
    marker, go = tmp / f"{mode}.ready", tmp / f"{mode}.go"
    for p in (marker, go):
        p.unlink(missing_ok=True)
    args = [str(a) for a in (RECIPE, log_dir, cache, mode, marker, go, *extra)]
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, *args],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    t0 = time.time()
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"child exited {proc.returncode} early:\n{proc.stdout.read()}")
        if time.time() - t0 > 240:
            proc.kill()
            pytest.fail("child never reached its waiting point")
        time.sleep(0.05)
    return proc, go


def _train_cli(log_dir: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nemo_jetrl.cli", "train", str(EXAMPLES / f"{RECIPE}.yaml")]
    cmd += [*TINY_OVERRIDES, f"jetrl.local.cache_dir={cache}", f"logger.log_dir={log_dir}"]
    cmd += [*extra, "--backend", "local", "--no-progress"]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def _no_timing(h: dict) -> dict:
    return {k: v for k, v in h.items() if not k.startswith(("timing/", "jetrl/local/cpu_time/"))}


# ------------------------------------------------------------------------ one run per directory


def test_second_live_run_into_same_dir_exits_2_naming_holder(tmp_path, cache_dir):
    log_dir = tmp_path / "run"
    holder, go = _child(tmp_path, log_dir, cache_dir, "on_run", "grpo.max_num_steps=1")
    try:
        before = _tree(log_dir)
        second = _train_cli(log_dir, cache_dir, "grpo.max_num_steps=1")
        assert second.returncode == 2, second.stderr
        assert f"pid {holder.pid}" in second.stderr and "logger.log_dir" in second.stderr
        assert "in use by another run" in second.stderr and "Traceback" not in second.stderr
        assert _tree(log_dir) == before  # the refused run wrote nothing
    finally:
        go.write_text("go")
        out, _ = holder.communicate(timeout=300)
    assert holder.returncode == 0, out
    assert not (log_dir / LOCK_FILE).exists()  # released on a normal exit
    assert [s for s, _ in ckpt.list_checkpoints(log_dir / "checkpoints")] == [1]


def test_a_fresh_run_into_an_earlier_runs_log_dir_is_refused(tmp_path, cache_dir):
    """Checkpointing off, two runs one after the other into one logger.log_dir: the second
    once replaced the first's config.yaml (seed 42 -> 43) and train data with only a note."""
    log_dir = tmp_path / "run"
    off = ("grpo.max_num_steps=1", "grpo.val_period=0", "checkpointing.enabled=false")
    run_local(
        resolve_run(tiny_cfg(RECIPE, log_dir, cache_dir, *off)), progress=False, log=lambda m: None
    )
    before = {p.name: p.read_bytes() for p in log_dir.iterdir() if p.is_file()}
    assert "config.yaml" in before
    second = tiny_cfg(RECIPE, log_dir, cache_dir, *off, "grpo.seed=43")
    with pytest.raises(UserError, match=r"already holds an earlier run \(TensorBoard events, "
                       r"config\.yaml, 1 train_data_step\*\.jsonl\).*--resume"):  # fmt: skip
        run_local(resolve_run(second), progress=False, log=lambda m: None)
    assert {p.name: p.read_bytes() for p in log_dir.iterdir() if p.is_file()} == before


def test_stale_lock_of_killed_run_is_taken_over(tmp_path, cache_dir):
    log_dir = tmp_path / "run"
    holder, _go = _child(tmp_path, log_dir, cache_dir, "on_run", "grpo.max_num_steps=1")
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    assert str(holder.pid) in (log_dir / LOCK_FILE).read_text()  # the dead holder's lock stays
    msgs: list[str] = []
    res = run_local(
        resolve_run(tiny_cfg(RECIPE, log_dir, cache_dir, "grpo.max_num_steps=1")),
        progress=False,
        log=msgs.append,
    )
    assert res.last_step == 1
    assert any(f"stale lock of pid {holder.pid}" in m for m in msgs), msgs
    assert not (log_dir / LOCK_FILE).exists()


def test_lock_is_released_on_exception_and_held_in_process(tmp_path, cache_dir):
    cfg = tiny_cfg(RECIPE, tmp_path / "run", cache_dir, "grpo.max_num_steps=1")
    lock = RunDirLock("other").acquire([("logger.log_dir", tmp_path / "run")])
    with lock, pytest.raises(RunDirBusy, match=f"pid {os.getpid()}"):
        run_local(resolve_run(cfg), progress=False, log=print)

    def boom(run):
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        run_local(resolve_run(cfg), progress=False, log=print, hooks=Hooks(on_run=boom))
    assert not (tmp_path / "run" / LOCK_FILE).exists()
    assert not (tmp_path / "run" / "checkpoints" / LOCK_FILE).exists()


# ----------------------------------------------------------------------- kill -9 during a save


def test_kill_during_save_then_resume_matches_uninterrupted_run(tmp_path, cache_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nemo_jetrl.runs.logs import find_event_files, read_event_file, read_scalars, run_ids

    extra = ("grpo.max_num_steps=3", "grpo.val_period=0")
    full = run_local(
        resolve_run(tiny_cfg(RECIPE, tmp_path / "full", cache_dir, *extra)), progress=False
    )
    part = tmp_path / "part"
    child, _go = _child(tmp_path, part, cache_dir, "save3", *extra)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    ck = part / "checkpoints"
    assert [p.name for p in ck.glob(".step_3.tmp-*")] == [f".step_3.tmp-{child.pid}"]
    assert [s for s, _ in ckpt.list_checkpoints(ck)] == [1, 2]
    msgs: list[str] = []
    res = run_local(
        resolve_run(tiny_cfg(RECIPE, part, cache_dir, *extra)),
        resume=True,
        progress=False,
        log=msgs.append,
    )
    text = "\n".join(msgs)
    assert f"stale lock of pid {child.pid}" in text
    assert f".step_3.tmp-{child.pid} left by an interrupted save" in text
    assert f"resumed from {ck / 'step_2'}" in text
    assert res.first_step == 2 and not list(ck.glob(".step_*"))
    assert _no_timing(full.history[2]) == _no_timing(res.history[0])
    name = "train_data_step3.jsonl"
    assert (tmp_path / "full" / name).read_text() == (part / name).read_text()
    # the killed run's step 3, purged from the logs, kept aside (no reader recomputes it)
    [aside] = (part / "superseded").glob(f"from_step3_*/{name}")
    assert aside.read_text() == (part / name).read_text()  # and redone to the same bytes
    assert "moved the replaced steps' train data" in text
    (_, fa), (_, pa) = (ckpt.list_checkpoints(tmp_path / d / "checkpoints")[-1] for d in ("full", "part"))  # fmt: skip
    (ma, sa), (mb, sb) = ckpt.load_checkpoint(fa), ckpt.load_checkpoint(pa)
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert run_ids(part) == (sb["run_id"],)  # killed and resumed: one run, one id
    assert sa["run_id"] != sb["run_id"]
    # the killed run logged step 3 before its save; the resumed run logged it again
    raw = [read_event_file(f)[0].get("train/reward", {}) for f in find_event_files(part)]
    assert sum(3 in pts for pts in raw) == 2
    # TensorBoard's own reader keeps each step once (the resumed file's restart marker) ...
    acc = EventAccumulator(str(part / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert len(tags) > 20
    for tag in tags:
        steps = [e.step for e in acc.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)
    # ... with the resumed values, which equal the uninterrupted run's; ours agrees
    sf, _ = read_scalars(tmp_path / "full")
    sp, _ = read_scalars(part)
    for tag in ("train/reward", "train/token_mult_prob_error", "train/loss"):
        assert [e.value for e in acc.Scalars(tag)] == list(sf[tag].values), tag
        assert sp[tag].steps == sf[tag].steps and sp[tag].values == sf[tag].values, tag


# ---------------------------------------------------------------- torn checkpoints, resume
