"""A local run refused at its run directories (an earlier run's files there, its checkpoints)
leaves nothing behind: the directories the run-dir lock made for it go too (before: an empty
``checkpoints/`` in the user's directory, e.g. with ``logger.log_dir=.``)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from local_configs import tiny_cfg

from nemo_jetrl.backends.local.loop import resolve_run, run_local
from nemo_jetrl.errors import UserError
from nemo_jetrl.runs.lock import RunDirLock


def _tree(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def test_a_refused_fresh_run_leaves_no_directory_it_made(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_data_step1.jsonl").write_text("{}\n")  # an earlier run's
    cfg = tiny_cfg(
        "jetrl", run, tmp_path / "cache", "checkpointing.checkpoint_dir=" + str(run / "a/b")
    )
    with pytest.raises(UserError, match="already holds an earlier run"):
        run_local(resolve_run(cfg), progress=False, log=lambda _m: None)
    assert _tree(run) == ["train_data_step1.jsonl"]  # no a/, a/b/, lock file
    assert not (tmp_path / "cache").exists()


def test_abandon_removes_only_the_empty_directories_acquire_made(tmp_path):
    kept = tmp_path / "kept"
    kept.mkdir()
    lock = RunDirLock("r").acquire([("k1", kept), ("k2", tmp_path / "x/y"), ("k3", tmp_path / "z")])
    assert (tmp_path / "x/y").is_dir() and (tmp_path / "z").is_dir()
    (tmp_path / "z" / "user.txt").write_text("written meanwhile")
    lock.abandon()
    lock.abandon()  # idempotent
    assert _tree(tmp_path) == ["kept", "z", "z/user.txt"]
    RunDirLock("s").acquire([("k", tmp_path / "w")]).release()  # a release keeps what it made
    assert (tmp_path / "w").is_dir()
