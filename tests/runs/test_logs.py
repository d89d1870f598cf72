"""NeMo-RL run directories: real TensorBoard files (incl. truncated/corrupt), jsonl recompute."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from nemo_jetrl.rl.metrics import mismatch_metrics
from nemo_jetrl.runs.logs import (
    RunDataWarning,
    find_event_files,
    read_run,
    train_data_tensors,
)
from nemo_jetrl.runs.writer import RunWriter

LN = math.log


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunDataWarning)
        yield


def nemo_rl_sample(gen, prev, mask, reward, sample_mask=1):
    """One line as NeMo-RL's log_batched_dict_as_jsonl writes it: every field a batch of one."""
    return {
        "content": ["<prompt> <answer>"],
        "rewards": [reward],
        "input_lengths": [len(gen)],
        "token_ids": [[1] * len(gen)],
        "token_loss_mask": [mask],
        "sample_loss_mask": [sample_mask],
        "advantages": [[0.0] * len(gen)],
        "generation_logprobs": [gen],
        "prev_logprobs": [prev],
    }


def write_nemo_rl_jsonl(path: Path, samples):
    with path.open("w") as f:
        for i, s in enumerate(samples):
            f.write(json.dumps({**s, "idx": i}) + "\n")


def step_samples(step: int):
    """Position 0 is the prompt's first token: NeMo-RL's loss ignores it ([:, 1:]); we put a
    mask 1 and junk there to prove it is ignored. Valid tokens of step s:
    sample A: d = p - g = -s*ln2 (rho = 2^-s) and 0; sample B: d = 0 (reward 1 vs 0)
    token_mult_prob_error = (2^s + 1 + 1) / 3
    """
    a = nemo_rl_sample([0.0, LN(0.5), -1.0], [-50.0, LN(0.5) - step * LN(2), -1.0], [1, 1, 1], 1.0)
    b = nemo_rl_sample([0.0, -2.0, 0.0], [9.0, -2.0, 0.0], [1, 1, 0], 0.0)
    return [a, b]


def make_nemo_rl_run(root: Path, steps=(1, 2, 3)) -> Path:
    """A run dir laid out like NeMo-RL's Logger: tensorboard/ with scalars (and an hparams
    sub-dir), train_data_step{N}.jsonl beside it. TensorBoard has reward and validation
    accuracy, but not token_mult_prob_error (as if an old NeMo-RL version)."""
    from torch.utils.tensorboard import SummaryWriter

    run = root / "exp_001"
    w = SummaryWriter(log_dir=str(run / "tensorboard"))
    for s in steps:
        w.add_scalar("train/reward", 0.5 + 0.1 * s, s)
        w.add_scalar("timing/train/total_step_time", 10.0 + s, s)
        if s % 2 == 1:
            w.add_scalar("validation/accuracy", 0.2 * s, s)
    w.add_hparams({"grpo.num_prompts_per_step": 2, "policy.model_name": "tiny"}, {})
    w.close()
    for s in steps:
        write_nemo_rl_jsonl(run / f"train_data_step{s}.jsonl", step_samples(s))
    return run


def test_reads_nemo_rl_layout_and_recomputes_missing_metrics(tmp_path):
    run_dir = make_nemo_rl_run(tmp_path)
    assert len(find_event_files(run_dir)) >= 2  # scalars + add_hparams' sub-directory
    run = read_run(run_dir)
    assert run.label == "exp_001" and run.warnings == []  # no jetrl.recipe anywhere
    assert run.hparams == {"grpo.num_prompts_per_step": 2, "policy.model_name": "tiny"}
    r = run.scalars["train/reward"]
    assert r.source == "tensorboard" and r.steps == (1, 2, 3)
    assert r.values == pytest.approx([0.6, 0.7, 0.8], rel=1e-6)  # float32 in the events file
    acc = run.scalars["validation/accuracy"]
    assert acc.steps == (1, 3) and acc.values == pytest.approx([0.2, 0.6], rel=1e-6)
    t = run.scalars["train/token_mult_prob_error"]
    assert t.source == "jsonl" and t.steps == (1, 2, 3)
    # (2^s + 2) / 3: 4/3, 2, 10/3
    assert t.values == pytest.approx([4 / 3, 2.0, 10 / 3], rel=1e-14)
    # gen_kl k3(-s ln2) = 2^-s + s ln2 - 1, over 3 tokens
    g = run.scalars["train/gen_kl_error"].values
    assert g == pytest.approx([(2**-s + s * LN(2) - 1) / 3 for s in (1, 2, 3)], rel=1e-12)


def test_recompute_always_prefers_jsonl(tmp_path):
    run_dir = make_nemo_rl_run(tmp_path)
    run = read_run(run_dir, recompute="always")
    r = run.scalars["train/reward"]
    assert r.source == "tensorboard+jsonl"
    assert r.values == pytest.approx([0.5, 0.5, 0.5])  # mean of rewards 1 and 0
    none = read_run(run_dir, recompute="never")
    assert "train/token_mult_prob_error" not in none.scalars


def test_train_data_tensors_masks_position_zero_and_pads():
    recs = step_samples(1)
    recs[1]["generation_logprobs"] = [[0.0, -2.0]]  # shorter row: padded
    recs[1]["prev_logprobs"] = [[9.0, -2.0]]
    recs[1]["token_loss_mask"] = [[1, 1]]
    t = train_data_tensors(recs)
    assert t["token_mask"].tolist() == [[False, True, True], [False, True, False]]
    assert math.isnan(t["generation_logprobs"][1, 2])
    assert t["rewards"].tolist() == [1.0, 0.0]
    m = mismatch_metrics(
        t["generation_logprobs"], t["prev_logprobs"], t["token_mask"], t["sample_mask"]
    )
    assert m["train/token_mult_prob_error"] == pytest.approx(4 / 3)
    with pytest.raises(ValueError, match="'prev_logprobs' is missing"):
        train_data_tensors([{"generation_logprobs": [[0.0]], "token_loss_mask": [[1]]}])


def test_truncated_and_corrupt_event_files_give_partial_results(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    run_dir = tmp_path / "run"
    w = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
    for s in range(1, 6):
        w.add_scalar("train/token_mult_prob_error", 1.0 + 0.01 * s, s)
    w.close()
    (ev,) = find_event_files(run_dir)
    data = ev.read_bytes()
    ev.write_bytes(data[:-7])  # cut inside the last record (step 5)
    # a second, corrupt file (garbage after the header record) in another sub-directory
    bad = run_dir / "tensorboard" / "old" / "events.out.tfevents.1.host.1"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(data[:40] + b"\x07garbage" * 20)
    with pytest.warns(RunDataWarning, match="truncated or corrupt"):
        warnings.simplefilter("always", RunDataWarning)
        run = read_run(run_dir)
    s = run.scalars["train/token_mult_prob_error"]
    assert s.steps == (1, 2, 3, 4)
    assert s.values == pytest.approx([1.01, 1.02, 1.03, 1.04], rel=1e-6)
    assert sum("truncated or corrupt" in m for m in run.warnings) == 2
    assert any(str(ev) in m for m in run.warnings)


def test_broken_jsonl_lines_and_missing_fields_warn(tmp_path):
    run_dir = make_nemo_rl_run(tmp_path, steps=(1, 2))
    p1 = run_dir / "train_data_step1.jsonl"
    p1.write_text(p1.read_text() + '{"generation_logprobs": [[0.0, -1')  # torn last line
    p2 = run_dir / "train_data_step2.jsonl"
    p2.write_text(json.dumps({"generation_logprobs": [[0.0]], "token_loss_mask": [[1]]}) + "\n")
    run = read_run(run_dir)
    t = run.scalars["train/token_mult_prob_error"]
    assert t.steps == (1,) and t.values == pytest.approx([4 / 3])
    assert any("skipped 1 unreadable line" in m for m in run.warnings)
    assert any("'prev_logprobs' is missing" in m and "step2" in m for m in run.warnings)


def test_empty_and_missing_dirs(tmp_path):
    run = read_run(tmp_path)
    assert run.scalars == {} and any("no TensorBoard events" in m for m in run.warnings)
    (tmp_path / "events.out.tfevents.1").write_bytes(b"not events")  # corrupt: said, not absent
    with pytest.warns(UserWarning):
        run = read_run(tmp_path)
    assert any("truncated or corrupt events file" in m for m in run.warnings), run.warnings
    assert any("no scalars read from its 1 TensorBoard events file(s)" in m for m in run.warnings)
    assert not any("no TensorBoard events" in m for m in run.warnings)
    with pytest.raises(FileNotFoundError, match="run directory not found"):
        read_run(tmp_path / "nope")


def test_later_wall_time_wins_for_a_repeated_step(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    for i, (val, wall) in enumerate([(1.0, 100.0), (2.0, 200.0)]):
        w = SummaryWriter(log_dir=str(tmp_path / "r" / "tensorboard"), filename_suffix=f".{i}")
        w.add_scalar("train/reward", val, 3, walltime=wall)
        w.close()
    run = read_run(tmp_path / "r")
    assert run.scalars["train/reward"].values == (2.0,)


def test_run_writer_round_trip_and_label(tmp_path):
    g = torch.tensor([[0.0, -1.0, -2.0]])
    p = torch.tensor([[0.0, -1.1, -2.0]])
    tm = torch.tensor([[0, 1, 1]])
    m = mismatch_metrics(g, p, tm)
    with RunWriter(tmp_path / "jet", config={"grpo": {"seed": 1}}, recipe="jetrl") as w:
        for step in (1, 2):
            w.log_scalars(step, m)
            w.log_scalars(
                step, {"reward": 0.25 * step, "note": "text", "vec": [1, 2]}, prefix="train"
            )
            w.log_scalars(step, {"accuracy": torch.tensor(0.5)}, prefix="validation")
            w.log_train_data(
                step,
                [
                    {
                        "generation_logprobs": g[0],
                        "prev_logprobs": p[0],
                        "token_loss_mask": tm[0],
                        "sample_loss_mask": 1,
                        "rewards": 0.25 * step,
                    }
                ],
            )
    line = json.loads((tmp_path / "jet" / "train_data_step1.jsonl").read_text())
    assert line["generation_logprobs"] == [[0.0, -1.0, -2.0]] and line["idx"] == 0  # NeMo-RL shape
    run = read_run(tmp_path / "jet")
    assert run.label == "jetrl" and run.config["grpo"]["seed"] == 1
    assert run.scalars["train/reward"].values == pytest.approx([0.25, 0.5])
    assert run.scalars["validation/accuracy"].values == pytest.approx([0.5, 0.5])
    assert "train/note" not in run.scalars and "train/vec" not in run.scalars
    tmpe = run.scalars["train/token_mult_prob_error"]
    assert tmpe.source == "tensorboard"  # logged, so not recomputed
    # exp(0.1) from the written float32 values, via the float32 events file
    assert tmpe.values[0] == pytest.approx(m["train/token_mult_prob_error"], rel=1e-6)
    assert run.scalars["jetrl/mismatch/num_valid_tokens"].values == (2.0, 2.0)


def test_label_from_nemo_rl_hparams_when_no_config(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(log_dir=str(tmp_path / "exp_007" / "tensorboard"))
    w.add_scalar("train/reward", 1.0, 1)
    w.add_hparams({"jetrl.recipe": "jetrl_kv", "grpo.seed": 42}, {})  # NeMo-RL's flatten_dict
    w.close()
    run = read_run(tmp_path / "exp_007")
    assert run.label == "jetrl_kv" and run.hparams["grpo.seed"] == 42


def test_restart_marker_drops_later_steps_of_earlier_file(tmp_path):
    """A resumed run (``purge_step``) hides what the killed run logged at or after that step,
    for TensorBoard's own reader and for ours, and both files carry the run id."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nemo_jetrl.runs.logs import read_scalars, run_ids

    with RunWriter(tmp_path, run_id="r1") as w:  # the killed run: steps 1-3, checkpoint at 2
        for s in (1, 2, 3):
            w.log_scalars(s, {"train/reward": float(s), "train/only_old": 1.0})
    # no sleep: the writer itself starts the resumed file after the killed one's second
    with RunWriter(tmp_path, run_id="r1", purge_step=3) as w:  # resumed from step 2
        w.log_scalars(4, {"train/reward": 40.0})
    series, warns = read_scalars(tmp_path)
    assert not warns
    assert series["train/reward"].steps == (1, 2, 4)
    assert series["train/reward"].values == (1.0, 2.0, 40.0)
    assert series["train/only_old"].steps == (1, 2)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/reward")] == [1, 2, 4]
    assert run_ids(tmp_path) == ("r1",)
    assert all(p.name.endswith(".jetrl-run-r1") for p in find_event_files(tmp_path))


def test_a_run_resumed_within_its_killed_runs_second_still_sorts_after_it(tmp_path):
    """Events file names start with the creation second, then host and pid: a killed child
    (larger pid) and a run resumed in the same second would sort resumed-first, and the restart
    marker would purge nothing (seen in test_faults_run_dirs on a fast machine). The writer waits
    for the next second instead."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with RunWriter(tmp_path, run_id="r1") as w:
        for s in (1, 2, 3):
            w.log_scalars(s, {"train/reward": float(s)})
    (old,) = find_event_files(tmp_path)
    parts = old.name.split(".")
    parts[3], parts[5] = f"{int(time.time()):010d}", "99999999"  # this second, a later pid
    old.rename(old.with_name(".".join(parts)))
    with RunWriter(tmp_path, run_id="r1", purge_step=3) as w:
        w.log_scalars(3, {"train/reward": 30.0})
    names = sorted(p.name for p in find_event_files(tmp_path))
    assert names[0] == ".".join(parts), names
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/reward")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
    ]
