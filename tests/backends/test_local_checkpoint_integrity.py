"""A checkpoint whose bytes changed but not its size (one flipped bit in the weights) is refused
on resume and by `load_checkpoint`; resume takes the newest checkpoint that verifies."""

from __future__ import annotations

import struct

import pytest
import torch

from nemo_jetrl.backends.local import checkpoint as ckpt


def _save_two(root) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    saved = {}
    for step in (1, 2):
        master = {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}
        ckpt.save_checkpoint(root, step, master, {"optimizer": {}, "run_id": "r"})
        saved[step] = master
    return saved


def _flip_one_weight_bit(path) -> None:
    """Flip the lowest mantissa bit of the first weight: same size, still a finite float."""
    raw = bytearray(path.read_bytes())
    data_start = 8 + struct.unpack("<Q", raw[:8])[0]  # safetensors: u64 header length, header
    raw[data_start] ^= 0x01
    path.write_bytes(bytes(raw))


def test_resume_takes_the_newest_good_checkpoint(tmp_path) -> None:
    saved = _save_two(tmp_path)
    d, master, state = ckpt.find_resumable(tmp_path, log=lambda _m: None)
    assert d.name == "step_2" and state["step"] == 2
    assert all(torch.equal(master[k], saved[2][k]) for k in saved[2])


def test_same_size_bit_flip_is_refused_on_resume(tmp_path) -> None:
    saved = _save_two(tmp_path)
    model = tmp_path / "step_2" / ckpt.MODEL_FILE
    size = model.stat().st_size
    _flip_one_weight_bit(model)
    assert model.stat().st_size == size
    # the flipped file still loads and is finite: only the hash can tell
    from safetensors.torch import load_file

    flipped = load_file(str(model))
    assert all(torch.isfinite(t).all() for t in flipped.values())
    assert any(not torch.equal(flipped[k], saved[2][k]) for k in saved[2])

    problems = ckpt.verify_checkpoint(tmp_path / "step_2")
    assert problems and "sha256" in problems[0], problems
    with pytest.raises(ckpt.CheckpointError, match="sha256"):
        ckpt.load_checkpoint(tmp_path / "step_2")
    logs: list[str] = []
    d, master, state = ckpt.find_resumable(tmp_path, log=logs.append)
    assert d.name == "step_1" and state["step"] == 1
    assert all(torch.equal(master[k], saved[1][k]) for k in saved[1])
    assert any("step_2" in m and "sha256" in m for m in logs), logs


def test_no_good_checkpoint_is_an_error_not_a_fresh_start(tmp_path) -> None:
    _save_two(tmp_path)
    for step in (1, 2):
        _flip_one_weight_bit(tmp_path / f"step_{step}" / ckpt.MODEL_FILE)
    with pytest.raises(ckpt.CheckpointError, match="no usable checkpoint"):
        ckpt.find_resumable(tmp_path, log=lambda _m: None)


def test_a_checkpoint_a_gpu_run_wrote_resumes_on_a_cpu(tmp_path, monkeypatch) -> None:
    """A CUDA run's optimizer state is saved with CUDA locations; without a map_location every
    such checkpoint "does not load" on a machine without CUDA, and --resume asked to remove
    good checkpoints. FAKE of the device: torch.save records "cuda:0" as a GPU run's would."""
    import torch.serialization as ser

    opt = {"state": {0: {"exp_avg": torch.full((3,), 0.5)}}, "param_groups": []}
    with monkeypatch.context() as m:
        m.setattr(ser, "location_tag", lambda storage: "cuda:0")
        ckpt.save_checkpoint(tmp_path, 1, {"w": torch.ones(3)}, {"optimizer": opt, "run_id": "r"})
    raw = (tmp_path / "step_1" / ckpt.STATE_FILE).read_bytes()
    assert b"cuda:0" in raw  # the fake took: a GPU-located state
    d, master, state = ckpt.find_resumable(tmp_path, log=lambda _m: None)
    assert d.name == "step_1" and torch.equal(master["w"], torch.ones(3))
    assert state["optimizer"]["state"][0]["exp_avg"].device.type == "cpu"
