"""`jetrl demo` checks every option and every run's config before any work, deletes only what an
earlier demo made, and stops every run on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_configs import REPO, TINY_OVERRIDES

from nemo_jetrl.cli import main
from nemo_jetrl.commands._demo_stats import derive_seeds
from nemo_jetrl.errors import UserError

pytest.importorskip("transformers")

SEEDS = derive_seeds(42, 3).grpo  # the GRPO seeds of `--n-seeds 3` on the default base seed


def _tiny(tmp_path: Path, study: bool = False) -> list[str]:
    """Test-size runs (should a refusal fail to come, they end in seconds)."""
    keep = [kv for kv in TINY_OVERRIDES if not (study and kv.startswith("jetrl.local.task.num"))]
    sets = [*keep, f"jetrl.local.cache_dir={tmp_path / 'cache'}"]
    return [a for kv in sets for a in ("--set", kv)] + ["--no-progress", "--steps", "1"]


def _demo(capsys, tmp_path: Path, *argv: str, study: bool = False) -> tuple[int, str]:
    code = main(["demo", "--out", str(tmp_path / "out"), *_tiny(tmp_path, study), *argv])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def _user_files(tmp_path: Path) -> list[Path]:
    """A user's files where an earlier demo (or the user) put them under OUT/runs."""
    runs = tmp_path / "out" / "runs"
    files = [
        runs / "bf16" / f"seed-{SEEDS[0]}" / "my_notes.txt",
        runs / "jetrl" / f"seed-{SEEDS[1]}" / "my_notes.txt",
        runs / "my_real_training" / "ckpt" / "model.pt",
    ]
    for f in files:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("mine")
    return files


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--n-seeds", "3", "--set", "grpo.seed_typo=3"], ["did you mean grpo.seed?"]),
        (["--n-seeds", "3", "--set", "jetrl.local.task.val_size=abc"], ["val_size: got 'abc'"]),
        (["--study", "length", "--set", "grpo.typo=1"], ["grpo.typo: override"]),
        (  # every problem at once: options, then the configs they give
            ["--recipes", "nope", "--steps", "0", "--jobs", "0", "--num-ops", "-1"],
            ["4 problems", "--recipes: unknown", "--steps must be", "--jobs must", "--num-ops must"],
        ),
        (["--num-ops", "0", "--set", "typo=1"], ["2 problems", "--num-ops must", "typo: override"]),
        (  # the demo owns each run's directories, as it owns the seeds
            ["--n-seeds", "3", "--set", "logger.log_dir=x", "--set", "+checkpointing.checkpoint_dir=y"],
            ["--set logger.log_dir=x: the demo gives", "--set +checkpointing.checkpoint_dir=y"],
        ),
        (["--n-seeds", "3", "--recipes", "bf16,bf16"], ["--recipes: bf16 given twice"]),
        (["--study", "length", "--set", "grpo.seed=3"], ["takes its GRPO seeds from --seeds"]),
        # an option of the other mode is refused, not ignored
        (["--n-seeds", "3", "--recipes", "bf16", "--seeds", "1,2,3"], ["--seeds applies only to --study length"]),
        (["--n-seeds", "3", "--recipes", "bf16", "--lengths", "1"], ["--lengths applies only to --study"]),
        (
            ["--study", "length", "--lengths", "1", "--seeds", "1", "--recipes", "bf16",
             "--seed", "3", "--n-seeds", "4", "--jobs", "1"],
            [f"{o} applies only to the comparison (no --study)"
             for o in ("--recipes", "--seed", "--n-seeds", "--jobs")],
        ),
    ],
)  # fmt: skip
def test_refused_before_any_work_and_nothing_deleted(capsys, tmp_path, argv, needles):
    files = _user_files(tmp_path)
    code, text = _demo(capsys, tmp_path, *argv, study="--study" in argv)
    assert code == 2, text
    assert all(n in text for n in needles), text
    assert "==" not in text and "warm start" not in text, text  # no run, no warm start began
    assert all(f.read_text() == "mine" for f in files)


def test_refuses_what_no_demo_made_where_a_run_goes(capsys, tmp_path):
    files = _user_files(tmp_path)
    code, text = _demo(capsys, tmp_path, "--n-seeds", "3", "--recipes", "bf16,jetrl")
    assert code == 2, text
    assert f"seed-{SEEDS[0]} (my_notes.txt)" in text and f"seed-{SEEDS[1]} (my_notes.txt)" in text
    assert "==" not in text, text
    assert all(f.read_text() == "mine" for f in files)


@pytest.mark.parametrize("study", [False, True])
def test_an_out_that_is_a_file_is_said_once_before_any_config_is_built(
    capsys, tmp_path, monkeypatch, study
):
    """`--out afile`: one problem naming --out and the file, with the other options' problems,
    not one logger.log_dir problem per run after every config was checked (~27 s)."""
    from nemo_jetrl.commands import _demo_runs, _demo_study

    def no_config(*_a, **_k):
        raise AssertionError("a run's config was built for an --out that cannot hold it")

    monkeypatch.setattr(_demo_runs, "checked_config", no_config)
    monkeypatch.setattr(_demo_study, "study_runs", no_config)
    afile = tmp_path / "afile"
    afile.write_text("mine")
    mode = ["--study", "length", "--lengths", "0"] if study else ["--n-seeds", "3", "--jobs", "0"]
    code = main(["demo", "--out", str(afile), *_tiny(tmp_path, study), *mode])
    err = capsys.readouterr().err
    assert code == 2 and afile.read_text() == "mine"
    other = (
        "--lengths needs integers >= 1 and --seeds integers >= 0"
        if study
        else "--jobs must be >= 1"
    )
    head, *lines = err.splitlines()
    assert head == "jetrl demo: error: 2 problems, nothing run:", err
    assert sorted(lines) == sorted([
        f"  - {other}",
        f"  - --out {afile}: is a regular file, not a directory; choose another --out",
    ]), err  # fmt: skip
    # under a file: said once too, naming the file that blocks it
    code = main(["demo", "--out", str(afile / "sub"), *_tiny(tmp_path), "--n-seeds", "3"])
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines() == [
        f"jetrl demo: error: --out {afile / 'sub'}: cannot be created, {afile} is a regular file"
    ], err


def test_claim_replaces_only_what_a_demo_made(tmp_path):
    from nemo_jetrl.commands._demo_runs import DEMO_MARK, claim_run_dirs

    out = tmp_path / "out"
    old, fresh, mine = out / "runs/bf16/seed-1", out / "runs/bf16/seed-2", out / "runs/bf16/x"
    for d, names in ((old, (DEMO_MARK, "train_data_step1.jsonl")), (mine, ("ckpt",))):
        d.mkdir(parents=True)
        for n in names:
            (d / n).write_text("old")
    claim_run_dirs(out, [old, fresh])
    assert sorted(p.name for p in old.iterdir()) == [DEMO_MARK]  # replaced whole
    assert sorted(p.name for p in fresh.iterdir()) == [DEMO_MARK]
    assert (mine / "ckpt").read_text() == "old"  # not named by this demo: untouched
    (old / "train_data_step1.jsonl").write_text("new")
    with pytest.raises(UserError, match=r"bf16/x \(ckpt\)"):
        claim_run_dirs(out, [old, mine])
    assert (old / "train_data_step1.jsonl").read_text() == "new"  # refused before deleting


@pytest.mark.slow
def test_study_keeps_what_it_did_not_make(capsys, tmp_path):
    """The study used to delete all of OUT/runs; it replaces only its own run directories."""
    from nemo_jetrl.commands._demo_runs import DEMO_MARK

    files = _user_files(tmp_path)
    earlier = tmp_path / "out" / "runs" / "jetrl" / "ops1_seed5"  # an earlier study's run
    earlier.mkdir(parents=True)
    for name in (DEMO_MARK, "config.yaml", "train_data_step1.jsonl"):
        (earlier / name).write_text("old")
    code, text = _demo(capsys, tmp_path, "--study", "length", "--lengths", "1", "--seeds", "5",
                       study=True)  # fmt: skip
    assert code == 0, text
    assert all(f.read_text() == "mine" for f in files)
    assert (earlier / "config.yaml").read_text() != "old"
    assert (tmp_path / "out" / "study_length.json").exists()


@pytest.mark.slow
def test_ctrl_c_stops_every_run(tmp_path):
    """Ctrl-C with --jobs 2 and 3 runs: the 2 running runs stop, the queued one never starts;
    exit 130 within seconds, one line naming what finished and what was cut, no traceback."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "nemo_jetrl.cli", "demo", "--out", str(out),
            *_tiny(tmp_path)[:-1], "400", "--n-seeds", "3", "--recipes", "bf16", "--jobs", "2"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)  # fmt: skip
    runs = [out / "runs" / "bf16" / f"seed-{s}" for s in SEEDS]
    steps = lambda d: len(list(d.glob("train_data_step*.jsonl")))  # noqa: E731
    try:
        deadline = time.monotonic() + 240
        while not any(steps(d) for d in runs) and proc.poll() is None:
            assert time.monotonic() < deadline, "no run started"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        text, _ = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    except subprocess.TimeoutExpired as exc:
        text, took = exc.output, None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert took is not None, f"still running 30 s after Ctrl-C: {text}"
    assert proc.returncode == 130, text
    assert took < 20, (took, text)
    lines = [ln for ln in text.splitlines() if "interrupted" in ln]
    assert len(lines) == 1 and "0 of 3 runs finished" in lines[0], text
    assert all(f"bf16/seed-{s}" in lines[0].split("cut:")[1] for s in SEEDS), text
    assert "Traceback" not in text, text
    before = [steps(d) for d in runs]
    assert before[2] == 0, before  # the queued run (the third seed) never started
    time.sleep(3)  # no run process left writing steps
    assert [steps(d) for d in runs] == before
