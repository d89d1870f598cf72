"""A resubmitted NeMo-RL job resumes only a checkpoint its own recipe wrote (helper review,
2026-12-01: NeMo-RL reads only training_info.json, so a changed YAML or override went on from
another recipe's weights and optimizer state). The checkpoints here are what NeMo-RL's
CheckpointManager writes: ``step_N/config.yaml`` = ``yaml.safe_dump(master_config)``."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from nemo_jetrl.backends.nemo_rl import driver
from nemo_jetrl.backends.nemo_rl import launch as nr
from nemo_jetrl.backends.nemo_rl.resume_guard import latest_checkpoint, resume_problem
from nemo_jetrl.errors import UserError

QWEN = Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_8b_base"


def master(recipe: str, ckpt: Path, *overrides: str) -> dict:
    """The translated master config of one of our example configs, checkpointing to ``ckpt``."""
    cfg = copy.deepcopy(
        nr.prepare(str(QWEN / f"{recipe}.yaml"), list(overrides)).plan.master_config
    )
    cfg["checkpointing"] = {"enabled": True, "checkpoint_dir": str(ckpt)}
    return cfg


def checkpoint(ckpt: Path, step: int, cfg: dict) -> None:
    (ckpt / f"step_{step}").mkdir(parents=True)
    (ckpt / f"step_{step}" / "config.yaml").write_text(yaml.safe_dump(cfg))


def test_a_checkpoint_of_another_recipe_is_refused_naming_both(tmp_path):
    ckpt = tmp_path / "ckpt"
    checkpoint(ckpt, 2, master("bf16", ckpt))
    why = resume_problem(master("jetrl", ckpt))
    assert why is not None and why.startswith("checkpointing.checkpoint_dir: ")
    assert "step_2, written by recipe 'bf16', under this config's 'jetrl'" in why
    assert "rollout" in why and "train" in why and "point checkpointing.checkpoint_dir" in why
    assert resume_problem(master("bf16", ckpt)) is None  # the same recipe resumes


def test_the_newest_finished_step_is_the_one_compared(tmp_path):
    ckpt = tmp_path / "ckpt"
    checkpoint(ckpt, 2, master("bf16", ckpt))
    checkpoint(ckpt, 10, master("jetrl", ckpt))
    (ckpt / "tmp_step_12").mkdir()  # being written: NeMo-RL does not resume it
    assert latest_checkpoint(ckpt) == ckpt / "step_10"  # 10 > 2 as numbers, not as text
    assert resume_problem(master("jetrl", ckpt)) is None
    assert "written by recipe 'jetrl'" in (resume_problem(master("bf16", ckpt)) or "")


def test_a_scale_mode_change_alone_is_refused(tmp_path):
    """FP32 against power-of-two scales is an env var on the trainer: the checkpoint's bytes
    look the same, the numerics do not."""
    ckpt = tmp_path / "ckpt"
    checkpoint(ckpt, 1, master("jetrl", ckpt))
    flip = master("jetrl", ckpt)
    env = flip["policy"]["megatron_cfg"]["env_vars"]
    recipe = json.loads(env["NEMO_JETRL_RECIPE"])
    for side in ("train", "rollout"):
        for k in [k for k in recipe[side] if k.startswith("pow2")]:
            recipe[side][k] = False
    env["NEMO_JETRL_RECIPE"] = json.dumps(recipe, sort_keys=True)  # as `jetrl_fp32` would send
    why = resume_problem(flip) or ""
    assert "train.pow2_weight_scales" in why and "rollout.pow2_weight_scales" in why, why
    # what does not change the checkpoint's numbers resumes: an OOM fix to the calibration
    calib = master("jetrl", ckpt)
    env = calib["policy"]["megatron_cfg"]["env_vars"]
    recipe = json.loads(env["NEMO_JETRL_RECIPE"])
    recipe["kv_calibration"]["micro_batch_size"] = 1
    env["NEMO_JETRL_RECIPE"] = json.dumps(recipe, sort_keys=True)
    assert resume_problem(calib) is None


def test_a_checkpoint_of_another_model_is_refused_naming_both(tmp_path):
    """Review (session 39): Qwen3-8B's checkpoint resumed under Qwen3-4B's config passed the
    guard (same recipe); NeMo-RL then fails after Ray and model load, or, with the same shapes,
    trains on the other model's weights without a word."""
    ckpt = tmp_path / "ckpt"
    checkpoint(ckpt, 3, master("jetrl", ckpt))
    assert resume_problem(master("jetrl", ckpt)) is None
    other = master("jetrl", ckpt, "policy.model_name=Qwen/Qwen3-4B-Base")
    why = resume_problem(other) or ""
    assert why.startswith("checkpointing.checkpoint_dir: NeMo-RL would resume "), why
    assert "policy.model_name 'Qwen/Qwen3-8B-Base' (this config: 'Qwen/Qwen3-4B-Base')" in why
    assert "point checkpointing.checkpoint_dir at a new directory" in why
    # the tokenizer alone counts too (it defaults to the model)
    tok = master("jetrl", ckpt, "policy.tokenizer.name=Qwen/Qwen3-4B-Base")
    assert "policy.tokenizer.name 'Qwen/Qwen3-8B-Base'" in (resume_problem(tok) or "")


def test_a_checkpoint_without_our_recipe_and_no_checkpoint_at_all(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert resume_problem(master("jetrl", ckpt)) is None  # nothing to resume: a fresh start
    plain = master("jetrl", ckpt)
    del plain["policy"]["megatron_cfg"]["env_vars"]["NEMO_JETRL_RECIPE"]
    checkpoint(ckpt, 1, plain)
    assert "written without nemo_jetrl" in (resume_problem(master("jetrl", ckpt)) or "")
    off = master("jetrl", ckpt)
    off["checkpointing"]["enabled"] = False  # saving off: NeMo-RL still resumes what is there
    assert "written without nemo_jetrl" in (resume_problem(off) or "")


def test_the_launch_refuses_it_before_ray(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    checkpoint(ckpt, 2, master("bf16", ckpt))
    merged = master("jetrl", ckpt)
    merged["data"] = {}
    called = []
    monkeypatch.setattr(
        driver, "trainer_kind", lambda cfg, **_: called.append("kind") or driver.SYNC
    )
    with pytest.raises(UserError, match=r"written by recipe 'bf16', under this config's 'jetrl'"):
        driver.prepare_master(
            merged, {}, nemo_rl_dir=tmp_path, venv_base=tmp_path / "venvs",
            stock_entry="uv run --locked --extra mcore", vllm_entry="uv run --locked --extra vllm",
            vllm_patch=True, environ={}, next_log_dir=lambda d: d, preflight=called.append,
            cwd=tmp_path,
        )  # fmt: skip
    assert called == ["kind"]  # nothing after the checks: no preflight, no venv, no log dir
