"""Fault injection on local runs (issue 17): real subprocesses, real kills, real files.

Each case is a failure a user met: two runs into one directory, ``kill -9`` during a checkpoint
save, a truncated checkpoint, an update that overflows the weights, a log dir under a regular
file, ``compare -o`` onto a file, mixed runs in one directory, secrets in config.yaml. Sizes
are the shared tiny configs (tests/local_configs.py); subprocesses use one thread.
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

from local_configs import EXAMPLES, REPO, TINY_OVERRIDES, tiny_cfg

from nemo_jetrl.backends.local import checkpoint as ckpt
from nemo_jetrl.backends.local.loop import Hooks, resolve_run, run_local
from nemo_jetrl.cli import main
from nemo_jetrl.errors import UserError
from nemo_jetrl.runs.lock import LOCK_FILE, RunDirBusy, RunDirLock

TESTS = Path(__file__).resolve().parents[1]
RECIPE = "jetrl"  # the FP8-training recipe: the one whose resume must be exact


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """A warm-start cache filled once, in this process, before any subprocess reads it."""
    d = tmp_path_factory.mktemp("faults_cache")
    from nemo_jetrl.backends.local.setup import LocalRun, resolve_run

    LocalRun(resolve_run(tiny_cfg(RECIPE, tmp_path_factory.mktemp("warm"), d))).close()
    return d


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


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory, cache_dir) -> Path:
    d = tmp_path_factory.mktemp("two") / "run"
    run_local(resolve_run(tiny_cfg(RECIPE, d, cache_dir)), progress=False, log=print)
    return d


@pytest.mark.parametrize(
    "damage", ["truncate state.pt", "truncate model.safetensors", "legacy truncate state.pt"]
)
def test_torn_latest_checkpoint_resumes_from_previous(damage, tmp_path, cache_dir, two_step_run):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    ck = run / "checkpoints"
    good = {k: v.clone() for k, v in ckpt.load_checkpoint(ck / "step_2")[0].items()}  # mmap
    name = damage.split()[-1]
    target = ck / "step_2" / name
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    if damage.startswith("legacy"):  # a checkpoint from before manifests: loading must fail
        (ck / "step_2" / ckpt.MANIFEST_FILE).unlink()
    # a fresh start would mix with these checkpoints: refused, naming --resume
    with pytest.raises(UserError, match="--resume"):
        run_local(resolve_run(tiny_cfg(RECIPE, run, cache_dir)), progress=False, log=print)
    msgs: list[str] = []
    res = run_local(
        resolve_run(tiny_cfg(RECIPE, run, cache_dir)), resume=True, progress=False, log=msgs.append
    )
    text = "\n".join(msgs)
    why = "does not load" if damage.startswith("legacy") else f"{name} is "
    assert f"skipping {ck / 'step_2'}: " in text and why in text, text
    assert f"resumed from {ck / 'step_1'}" in text
    assert res.first_step == 1 and res.last_step == 2
    redone, _ = ckpt.load_checkpoint(ck / "step_2")  # redone, verified, equal to the original
    assert all(torch.equal(good[k], redone[k]) for k in good)
    assert ckpt.verify_checkpoint(ck / "step_2") == []


def test_no_usable_checkpoint_is_exit_2_not_a_fresh_start(tmp_path, two_step_run, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    for _, d in ckpt.list_checkpoints(run / "checkpoints"):
        (d / ckpt.STATE_FILE).write_bytes(b"torn")
    rc = main(
        [
            *("train", str(EXAMPLES / f"{RECIPE}.yaml"), *TINY_OVERRIDES),
            *(f"jetrl.local.cache_dir={tmp_path / 'cache'}", f"logger.log_dir={run}"),
            *("--backend", "local", "--no-progress", "--resume"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "no usable checkpoint" in err and "Traceback" not in err, err
    assert "step_2: state.pt is 4 bytes" in err and "step_1: state.pt is 4 bytes" in err, err
    assert [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")] == [1, 2]  # untouched
    assert not (tmp_path / "cache").exists()  # refused before any work (no warm start)


# --------------------------------------------------------------------- poisoned update, save


@pytest.mark.parametrize("bad_lr", [float("inf"), 1e38])
def test_overflowing_update_is_refused_and_nothing_non_finite_is_saved(bad_lr, tmp_path, cache_dir):
    """``lr=inf`` (the issue's case: NaN/inf weights) and ``lr=1e38`` (torch's Adam raises on
    the step size) at step 2 only: step 2's update is undone, step 3's is kept. Set on the
    optimizer after setup, as config validation rejects such a config before it runs."""
    run_ref: list = []

    def after_step(step, scalars):
        group = run_ref[0].trainer.optimizer.param_groups[0]
        if step == 1:
            run_ref.append(group["lr"])
        group["lr"] = bad_lr if step == 1 else run_ref[1]

    msgs: list[str] = []
    res = run_local(
        resolve_run(
            tiny_cfg(
                RECIPE, tmp_path / "run", cache_dir, "grpo.max_num_steps=3", "grpo.val_period=0"
            )
        ),
        progress=False,
        log=msgs.append,
        hooks=Hooks(on_run=run_ref.append, after_step=after_step),
    )
    assert [h["jetrl/local/update_refused"] for h in res.history] == [0.0, 1.0, 0.0]
    why = "non-finite" if bad_lr == float("inf") else "overflowed"
    assert any(m.startswith("step 2: update refused") and why in m for m in msgs), msgs
    ck = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(ck)] == [2, 3]
    assert all(ckpt.verify_checkpoint(ck / f"step_{i}") == [] for i in (2, 3))
    trainer = run_ref[0].trainer
    assert all(bool(torch.isfinite(p).all()) for p in trainer.params)
    # Adam's step count: step 2 kept step 1's state (one step), step 3's update was applied
    # (tiny-batch GRPO gradients can be zero, so the weights themselves may not move)
    for i, n in ((2, 1), (3, 2)):
        opt = ckpt.load_checkpoint(ck / f"step_{i}")[1]["optimizer"]["state"]
        assert opt and all(int(st["step"]) == n for st in opt.values()), (i, n)


def test_an_update_to_finite_but_huge_weights_is_refused(tmp_path, cache_dir):
    """``lr=1e10`` as a user met it: every weight stays finite (~1e10), but the next forward is
    NaN (once: a traceback at the next rollout, a poisoned checkpoint that --resume could not
    get past). Injected deterministically: step 2's update scales the fp32 masters by 1e10 (the
    tiny run's gradients are too sparse for lr alone to do it). The guard's probe forward
    refuses it; step 3 is kept; both checkpoints verify and load a finite forward."""
    from nemo_jetrl.backends.local.guard import _probe_problem

    calls, run_ref = [0], []

    def on_run(run):
        run_ref.append(run)
        trainer, real = run.trainer, run.trainer.update

        def update(*a, **k):
            out = real(*a, **k)
            calls[0] += 1
            if calls[0] == 2:
                trainer.load_master({n: m * 1e10 for n, m in trainer.master_state().items()})
            return out

        trainer.update = update

    msgs: list[str] = []
    cfg = tiny_cfg(RECIPE, tmp_path / "run", cache_dir, "grpo.max_num_steps=3", "grpo.val_period=0")
    res = run_local(resolve_run(cfg), progress=False, log=msgs.append, hooks=Hooks(on_run=on_run))
    assert [h["jetrl/local/update_refused"] for h in res.history] == [0.0, 1.0, 0.0]
    assert any(m.startswith("step 2: update refused: the updated policy's forward is not finite")
               for m in msgs), msgs  # fmt: skip
    trainer = run_ref[0].trainer
    assert max(float(m.abs().max()) for m in trainer.master) < 1e3  # the scaled weights are gone
    ck = tmp_path / "run" / "checkpoints"
    assert all(ckpt.verify_checkpoint(ck / f"step_{i}") == [] for i in (2, 3))
    ids = torch.ones(1, 8, dtype=torch.long)
    assert _probe_problem(trainer, ids, 4) == ""  # and the policy it keeps runs


def test_save_refuses_non_finite_tensors_and_writes_nothing(tmp_path):
    master = {"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")])}
    with pytest.raises(ckpt.CheckpointError, match=r"1 non-finite tensor\(s\) \(b\)"):
        ckpt.save_checkpoint(tmp_path, 1, master, {"optimizer": {}})
    opt = {"state": {0: {"exp_avg": torch.tensor([float("inf")])}}}
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer\.state\.0\.exp_avg"):
        ckpt.save_checkpoint(tmp_path, 1, {"a": torch.ones(3)}, {"optimizer": opt})
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ paths: log dir, compare -o


@pytest.mark.parametrize("key", ["logger.log_dir", "checkpointing.checkpoint_dir"])
def test_run_dir_under_a_regular_file_is_exit_2_before_any_work(key, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cache = tmp_path / "cache"
    log_dir = blocker / "run" if key == "logger.log_dir" else tmp_path / "run"
    rc = main(
        ["train", str(EXAMPLES / f"{RECIPE}.yaml"), *TINY_OVERRIDES]
        + [f"jetrl.local.cache_dir={cache}", f"logger.log_dir={log_dir}"]
        + ([f"checkpointing.checkpoint_dir={blocker / 'ck'}"] if "checkpoint" in key else [])
        + ["--backend", "local", "--no-progress"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and key in err and "Traceback" not in err, err
    assert not cache.exists()  # no warm start, no model built
    assert not (tmp_path / "run" / "train_data_step1.jsonl").exists()


def _tiny_run_dir(d: Path, run_id: str, steps=(1, 2)) -> None:
    from nemo_jetrl.runs.writer import RunWriter

    with RunWriter(d, config={"jetrl": {"recipe": "bf16"}}, run_id=run_id) as w:
        for s in steps:
            w.log_scalars(s, {"train/reward": 0.1 * s, "train/token_mult_prob_error": 1.0 + s})


def test_compare_output_on_existing_file_or_unwritable_path_is_exit_2(tmp_path, capsys):
    run = tmp_path / "run"
    _tiny_run_dir(run, "aaa")
    taken = tmp_path / "taken.json"
    taken.write_text("keep me")
    assert main(["compare", str(run), "-o", str(taken)]) == 2
    assert "existing file" in capsys.readouterr().err and taken.read_text() == "keep me"
    assert main(["compare", str(run), "-o", str(taken / "sub")]) == 2
    assert "regular file" in capsys.readouterr().err
    # /proc: os.access says yes to root there, creating fails (once a traceback)
    assert main(["compare", str(run), "-o", "/proc/jetrl_no_such_dir"]) == 2
    assert "-o /proc/jetrl_no_such_dir: cannot be created or written" in capsys.readouterr().err
    assert main(["compare", str(run), "-o", str(tmp_path / "ok"), "--no-plots"]) == 0
    assert (tmp_path / "ok" / "summary.json").is_file()


def test_align_output_where_it_cannot_be_written_is_exit_2_before_any_work(tmp_path, capsys):
    cfg = REPO / "examples" / "configs" / "nemo_rl_fp8_e2e.yaml"
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    for out, fragment in (
        (
            afile / "x.yaml",
            f"x.yaml: its directory {afile}: cannot be created, {afile} is a regular",
        ),
        (Path("/proc/jetrl_x/x.yaml"), "-o /proc/jetrl_x/x.yaml: its directory /proc/jetrl_x: can"),
        (tmp_path, "is a directory"),
    ):
        assert main(["align", str(cfg), "-o", str(out), "--force"]) == 2, out
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err, err
    assert afile.read_text() == "keep me"


def test_compare_refuses_or_labels_a_dir_with_two_runs(tmp_path, capsys):
    run = tmp_path / "run"
    _tiny_run_dir(run, "aaa")
    time.sleep(1.1)  # events file names carry the second they were created
    _tiny_run_dir(run, "aaa", steps=(3,))  # a resume: same run id, still one run
    out = tmp_path / "o"
    assert main(["compare", str(run), "-o", str(out), "--no-plots"]) == 0
    assert "mixed" not in capsys.readouterr().out
    _tiny_run_dir(run, "bbb")  # another run into the same directory
    assert main(["compare", str(run), "-o", str(out), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "2 different runs (aaa, bbb)" in err and "--allow-mixed" in err
    assert main(["compare", str(run), "-o", str(out), "--no-plots", "--allow-mixed"]) == 0
    assert "bf16 [mixed: 2 runs]" in capsys.readouterr().out


# ------------------------------------------------------------------------------ config.yaml


def test_config_yaml_keeps_env_interpolation_and_is_owner_only(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("JETRL_FAULT_SECRET", "s3cr3t-value")
    log_dir = tmp_path / "run"
    cfg = tiny_cfg(
        RECIPE,
        log_dir,
        cache_dir,
        "grpo.max_num_steps=1",
        "+logger.wandb.api_key=${oc.env:JETRL_FAULT_SECRET}",
    )
    run_local(resolve_run(cfg), progress=False, log=print)
    text = (log_dir / "config.yaml").read_text()
    assert "s3cr3t-value" not in text and "${oc.env:JETRL_FAULT_SECRET}" in text
    assert (log_dir / "config.yaml").stat().st_mode & 0o777 == 0o600
