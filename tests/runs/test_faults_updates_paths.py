"""Fault injection on local runs (issue 17), what a run refuses: an update that overflows the
weights (undone, nothing non-finite saved), a log or checkpoint dir under a regular file,
``compare -o`` / ``align -o`` onto a file or an unwritable path, mixed runs in one directory,
secrets in config.yaml. Sizes are the shared tiny configs (tests/local_configs.py). One run per
directory, ``kill -9`` during a save: tests/runs/test_faults_run_dirs.py; torn checkpoints and
other resumes: test_faults_resume.py.
"""

from __future__ import annotations

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
from nemo_jetrl.cli import main

cache_dir = fault_warm_cache.cache_dir  # the module-scoped warm-start cache (a fixture)


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


def test_the_probe_reads_the_flags_a_cuda_forward_leaves(tmp_path, cache_dir):
    """On CUDA the FP8 quantizers flag a non-finite operand (`fp8.finite_flags`) instead of
    raising as on CPU. The probe must read those flags: left pending, the next step's update
    raised on the good weights the guard had just restored. FAKE of the device's answer (no
    CUDA here): the probe's forward records the flag by hand, as the GPU quantizer's kernel
    would, and returns NaN log-probs."""
    from nemo_jetrl.backends.local.guard import _probe_problem
    from nemo_jetrl.backends.local.setup import LocalRun
    from nemo_jetrl.fp8 import check_non_finite, finite_flags

    run = LocalRun(resolve_run(tiny_cfg(RECIPE, tmp_path / "run", cache_dir)))
    try:
        trainer = run.trainer

        def cuda_like_score(ids, prompt_len):
            finite_flags.record("model.layers.0.mlp.down_proj.input", torch.tensor([float("nan")]))
            return torch.full((1, ids.shape[1] - prompt_len), float("nan"))

        trainer.score = cuda_like_score
        why = _probe_problem(trainer, torch.ones(1, 8, dtype=torch.long), 4)
        assert "model.layers.0.mlp.down_proj.input" in why, why
        assert finite_flags.pending() == 0
        check_non_finite()  # what the next step's update calls: nothing left to raise
    finally:
        finite_flags._FLAGS.clear()
        run.close()


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
    assert (
        main(["compare", str(run), "-o", str(out), "--no-plots", "--allow-mixed", "--force"]) == 0
    )
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
