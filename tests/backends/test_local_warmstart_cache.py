"""A warm-start cache that cannot be written costs the next run a retrain, never this run its
weights (review, session 41: an unwritable `jetrl.local.cache_dir` or `$JETRL_CACHE_DIR` crashed
the run with a traceback after the warm start had trained, exit 1). Said before training; a
failed write is a warning; the weights are the cached run's."""

from __future__ import annotations

import errno

import pytest
import torch

pytest.importorskip("transformers")

from nemo_jetrl.backends.local import warmstart
from nemo_jetrl.backends.local.config import TaskConfig, WarmStartSettings
from nemo_jetrl.backends.local.model import load_model_config
from nemo_jetrl.backends.local.tokenizer import load_tokenizer, tokenizer_file

WS = WarmStartSettings(steps=2, batch_size=4)


def _run(cache_dir):
    lines: list[str] = []
    weights, path, cached = warmstart.load_or_train(
        load_model_config(), load_tokenizer(), tokenizer_file(None).read_text(), TaskConfig(),
        WS, 7, cache_dir, log=lines.append,
    )  # fmt: skip
    return weights, path, cached, lines


def test_a_cache_dir_under_a_regular_file_trains_warns_and_keeps_the_weights(tmp_path):
    good, path, cached, _ = _run(tmp_path / "cache")  # control: cached and written
    assert not cached and path.is_file()
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    weights, path, cached, lines = _run(blocker / "sub")
    assert not cached and not path.exists()
    assert "not cached: " in lines[0] and "regular file" in lines[0]  # before the training
    assert any(ln.startswith("warning: the warm start was not cached") for ln in lines), lines
    assert weights.keys() == good.keys()
    assert all(torch.equal(weights[k], good[k]) for k in good)  # the same training
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "cache"]


def test_a_failed_write_is_a_warning_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    import safetensors.torch

    real = safetensors.torch.save_file

    def full_disk(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)  # a partial file, then the error
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    weights, path, cached, lines = _run(tmp_path / "cache")
    assert weights and not cached and not path.exists()
    assert list((tmp_path / "cache").iterdir()) == []
    assert any("No space left on device" in ln and ln.startswith("warning:") for ln in lines)
