"""What a local ``--resume`` takes from the checkpoint and what from the config: the recipe must
be the one that wrote it (compared field by field: two non-preset recipes are both named
"custom"), the optimizer's settings are the config's (a resubmission that lowers the learning
rate gets it). Runs end to end: tests/runs/test_faults_resume.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from nemo_jetrl.backends.local.resume import apply_optimizer_settings, recipe_refusal
from nemo_jetrl.backends.local.trainer import OptimConfig
from nemo_jetrl.config import ConfigError
from nemo_jetrl.recipe import PRESETS

CKPT = Path("/runs/x/checkpoints/step_4")


def _fp32(name: str):
    """``name``'s preset with FP32 scales on both sides, aligned: a recipe named "custom"."""
    r = PRESETS[name]
    fp32 = r.with_(train=r.train.with_(pow2_weight_scales=False, pow2_activation_scales=False))
    return fp32.aligned_to_training(kv="onpolicy" if r.onpolicy_kv else "bf16")


def test_two_custom_recipes_that_differ_are_refused_naming_the_fields() -> None:
    jetrl32, kv32 = _fp32("jetrl"), _fp32("jetrl_kv")
    assert jetrl32.name == kv32.name == "custom"  # the name alone cannot tell them apart
    state = {"recipe": kv32.name, "recipe_spec": kv32.to_dict()}
    with pytest.raises(ConfigError) as exc:
        recipe_refusal(state, jetrl32, CKPT)
    text = str(exc.value)
    assert "checkpointing.checkpoint_dir" in text and str(CKPT) in text
    assert "kv_cache_dtype" in text and "onpolicy_kv" in text
    recipe_refusal(state, kv32, CKPT)  # the same recipe resumes


def test_a_scale_mode_change_is_refused_and_a_calibration_setting_is_not() -> None:
    jetrl = PRESETS["jetrl_kv"]
    state = {"recipe": jetrl.name, "recipe_spec": jetrl.to_dict()}
    with pytest.raises(ConfigError, match="pow2"):
        recipe_refusal(state, _fp32("jetrl_kv"), CKPT)
    margin = jetrl.with_(kv_calibration=dataclasses.replace(jetrl.kv_calibration, margin=1.5))
    assert margin != jetrl
    recipe_refusal(state, margin, CKPT)  # an OOM / calibration fix resumes (as on NeMo-RL)


def test_a_checkpoint_from_before_the_whole_recipe_was_saved_is_judged_by_name() -> None:
    recipe_refusal({"recipe": "jetrl"}, PRESETS["jetrl"], CKPT)
    recipe_refusal({}, PRESETS["jetrl"], CKPT)
    with pytest.raises(ConfigError, match="'bf16'"):
        recipe_refusal({"recipe": "bf16"}, PRESETS["jetrl"], CKPT)


def test_a_resumed_optimizer_takes_the_configs_settings() -> None:
    w = torch.nn.Parameter(torch.ones(4))
    old = torch.optim.AdamW([w], lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    w.grad = torch.ones(4)
    old.step()
    new = torch.optim.AdamW([w], lr=1.0)
    new.load_state_dict(old.state_dict())
    assert new.param_groups[0]["lr"] == 3e-4  # what torch restores: the checkpoint's
    cfg = OptimConfig(lr=1e-7, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    msgs = apply_optimizer_settings(new, cfg)
    group = new.param_groups[0]
    assert (group["lr"], tuple(group["betas"])) == (1e-7, (0.9, 0.95))
    assert len(msgs) == 2
    assert "policy.optimizer.kwargs.lr 0.0003 in the checkpoint, 1e-07 in this config" in msgs[0]
    assert "policy.optimizer.kwargs.betas" in msgs[1]
    assert torch.equal(new.state[w]["exp_avg"], old.state[w]["exp_avg"])  # moments kept
    assert apply_optimizer_settings(new, cfg) == []  # unchanged config: silent
