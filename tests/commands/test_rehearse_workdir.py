"""`jetrl rehearse --workdir`: one it cannot write, or one holding an earlier rehearsal's
checkpoint (NeMo-RL would resume from it and run no step), is exit 2 naming it before any work:
no Ray, no NeMo-RL needed (this env has none, and the refusal comes before it is asked for)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_jetrl.backends.nemo_rl.launch import missing_dependencies
from nemo_jetrl.cli import main

CONFIG = (
    Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_8b_base" / "jetrl.yaml"
)


def _rehearse(workdir: Path | str, capsys) -> str:
    assert main(["rehearse", str(CONFIG), "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    return err


def test_a_workdir_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    err = _rehearse(f, capsys)
    assert f"--workdir {f}: cannot be created, {f} is a regular file" in err
    err = _rehearse(f / "sub", capsys)
    assert f"--workdir {f / 'sub'}: cannot be created, {f} is a regular file" in err


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_a_workdir_that_cannot_be_created_is_refused(capsys):
    err = _rehearse("/proc/jetrl_x", capsys)
    assert "--workdir /proc/jetrl_x: cannot be created or written" in err


def test_a_workdir_holding_an_earlier_rehearsal_is_refused(tmp_path, capsys):
    work = tmp_path / "rw"
    (work / "checkpoints" / "step_2").mkdir(parents=True)
    (work / "checkpoints" / "step_1").mkdir()
    err = _rehearse(work, capsys)
    ckpt = work / "checkpoints"
    assert f"--workdir {work} holds an earlier rehearsal (checkpoint {ckpt / 'step_2'})" in err
    assert f"pass a new --workdir (or none: a fresh temporary directory), or remove {ckpt}" in err
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_1", "step_2"]  # left as they were
    if missing_dependencies():  # (with NeMo-RL here what follows would rehearse)
        # logs, or a checkpoint NeMo-RL would not resume from (tmp_step_N), pass: the next
        # refusal here is NeMo-RL's absence, and nothing was created for a new workdir
        for p in ckpt.iterdir():
            p.rename(ckpt / f"tmp_{p.name}")
        (work / "logs").mkdir()
        assert "needs it importable here" in _rehearse(work, capsys)
        assert "needs it importable here" in _rehearse(tmp_path / "new" / "w", capsys)
        assert not (tmp_path / "new").exists()


def test_a_bad_workdir_is_named_with_the_configs_problems(tmp_path, capsys):
    """Session 41's review: the config's errors hid a --workdir that is a file (and the other
    way round); now both, before any work."""
    f = tmp_path / "file"
    f.write_text("x")
    argv = ["rehearse", str(CONFIG), "grpo.max_num_steps=abc", "--workdir", str(f)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "2 problems, nothing run" in err, err
    assert f"--workdir {f}: cannot be created" in err and "grpo.max_num_steps: got 'abc'" in err
    assert main(["rehearse", str(CONFIG), "grpo.max_num_steps=abc"]) == 2  # control: no workdir
    err = capsys.readouterr().err
    assert "grpo.max_num_steps: got 'abc'" in err and "--workdir" not in err, err
