"""The synchronous trainer runs inside NeMo-RL's own ``CheckpointManager`` context where the tree
has one (main: its ``run_grpo.py`` does the same), so a crash still finishes the background
rename of the last ``tmp_step_N`` (NeMo-RL tier, the tree's real class)."""

from __future__ import annotations

import contextlib
import time

import pytest

from nemo_jetrl.backends.nemo_rl.driver import flushed

pytestmark = pytest.mark.nemo_rl


def _manager(tmp_path):
    from nemo_rl.utils.checkpoint import CheckpointManager

    return CheckpointManager({
        "enabled": True, "checkpoint_dir": str(tmp_path), "metric_name": None,
        "higher_is_better": False, "keep_top_k": 3, "save_period": 1, "save_optimizer": False,
    })  # fmt: skip


def test_a_crash_still_finishes_the_last_checkpoints_rename(tmp_path):
    cm = _manager(tmp_path)
    if not hasattr(type(cm), "__exit__"):  # v0.7.0: renames in the foreground, nothing pending
        assert isinstance(flushed(cm), contextlib.nullcontext)
        assert not hasattr(cm, "begin_finalization")
        return
    tmp = tmp_path / "tmp_step_3"
    tmp.mkdir()
    (tmp / "training_info.json").write_text("{}")
    cm.begin_finalization(tmp, wait_fn=lambda: time.sleep(0.5))  # an async save still writing
    with pytest.raises(RuntimeError, match="a step failed"), flushed(cm):
        raise RuntimeError("a step failed")
    assert (tmp_path / "step_3" / "training_info.json").is_file() and not tmp.exists()
    # the control: the same crash outside the context leaves the rename pending
    tmp2 = tmp_path / "tmp_step_4"
    tmp2.mkdir()
    cm.begin_finalization(tmp2, wait_fn=lambda: time.sleep(0.5))
    with pytest.raises(RuntimeError), contextlib.nullcontext():
        raise RuntimeError("a step failed")
    assert tmp2.exists() and not (tmp_path / "step_4").exists()
    cm.shutdown()
