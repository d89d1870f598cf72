"""`jetrl train`'s ``--backend auto`` on a machine without NeMo-RL: a local config runs on the
local backend; a cluster config (a HF ``policy.model_name``, no ``jetrl.local.model_config``) is
refused with exit 2 before any work, where it used to train the local backend's own small model
for hours under the cluster config's step count; ``--backend local`` still runs it, saying so."""

from __future__ import annotations

from pathlib import Path

import pytest

import nemo_jetrl._optional as optional
from nemo_jetrl.cli import main

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "examples" / "configs" / "qwen3_8b_base" / "jetrl.yaml"


@pytest.fixture
def no_nemo_rl(monkeypatch):
    real = optional.available
    monkeypatch.setattr(
        optional, "available", lambda mod: False if mod.startswith("nemo_rl") else real(mod)
    )


def test_auto_refuses_a_cluster_config_without_nemo_rl(tmp_path, capsys, no_nemo_rl):
    log_dir = tmp_path / "logs"
    rc = main(["train", str(CLUSTER), f"logger.log_dir={log_dir}", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert "policy.model_name=Qwen/Qwen3-8B-Base" in err and "--backend local" in err, err
    assert not log_dir.exists()  # before any work


def test_explicit_local_runs_it_and_says_what_it_trains(tmp_path, capsys, no_nemo_rl, monkeypatch):
    import nemo_jetrl.backends.local.loop as loop

    ran = []
    monkeypatch.setattr(loop, "run_local", lambda resolved, **kw: ran.append(resolved) or 1 / 0)
    # the cluster config's max_new_tokens (16384) does not fit the local model's 256 positions:
    # refused before any work, naming the key (backends/local/seq_len.py)
    argv = ["train", str(CLUSTER), f"logger.log_dir={tmp_path}", "--backend", "local"]
    assert main(argv) == 2 and not ran
    assert "policy.generation.max_new_tokens" in capsys.readouterr().err
    with pytest.raises(ZeroDivisionError):  # stopped where the run would start
        main([*argv, "policy.generation.max_new_tokens=32"])
    out = capsys.readouterr().out
    assert "note: the config names policy.model_name=Qwen/Qwen3-8B-Base" in out, out
    assert len(ran) == 1


def test_auto_takes_a_local_config_without_a_word(tmp_path, capsys, no_nemo_rl, monkeypatch):
    import nemo_jetrl.backends.local.loop as loop

    monkeypatch.setattr(loop, "run_local", lambda resolved, **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(
            ["train", str(REPO / "examples/configs/local/jetrl.yaml"), f"logger.log_dir={tmp_path}"]
        )
    assert "policy.model_name" not in capsys.readouterr().out
