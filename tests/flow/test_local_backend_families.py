"""The local backend's per-backend verdict covers only the models it runs: an MoE family whose
blocks it does not swap (MiniMax-M2, DeepSeek-V3 / Moonlight, Qwen3.5-MoE) or shared experts
gets "not run" instead of "on-policy", and `jetrl train --backend local` refuses such a config
(exit 2, naming the key that chose the model) before any work starts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from nemo_jetrl.arch import builtin_arch
from nemo_jetrl.backends.local.families import local_family_problem

EX = Path(__file__).resolve().parents[2] / "examples" / "configs"
CFG = EX / "qwen3_8b_base" / "jetrl.yaml"
BF16 = EX / "qwen3_8b_base" / "bf16.yaml"  # nothing to tile: Moonlight's 576-row kv_a_proj


def _local_line(out: str) -> str:
    return next(x for x in out.splitlines() if x.startswith("  local: "))


@pytest.mark.parametrize(
    ("model", "why"),
    [
        ("MiniMaxAI/MiniMax-M2", "'minimax_m2' mixture of experts"),
        ("moonshotai/Moonlight-16B-A3B-Instruct", "'deepseek_v3' mixture of experts"),
        ("Qwen/Qwen3.5-35B-A3B-Base", "mixture of experts"),
    ],
)
def test_moe_families_the_local_backend_does_not_run_get_no_local_verdict(cli, model, why):
    code, out = cli("check", BF16, f"policy.model_name={model}", "--json")
    assert code in (0, 1), out
    local = next(b for b in json.loads(out)["backends"] if b["backend"] == "local")
    assert local["runs"] is False and why in local["reason"], local
    assert "(policy.model_name)" in local["reason"]
    code, out = cli("check", BF16, f"policy.model_name={model}")
    line = _local_line(out)
    assert line.startswith("  local: not run: ") and "on-policy" not in line, line
    assert "OFF-POLICY on local" not in out  # not run is no off-policy claim either


@pytest.mark.parametrize("model", ["Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-8B-Base"])
def test_models_it_runs_keep_their_verdict(cli, model):
    code, out = cli("check", CFG, f"policy.model_name={model}")
    assert code == 0 and _local_line(out).startswith("  local: on-policy: the recipe runs"), out


def test_shared_experts_are_not_run_even_in_a_family_it_runs():
    qwen3_moe = builtin_arch("Qwen/Qwen3-30B-A3B")
    assert local_family_problem(qwen3_moe) is None
    shared = dataclasses.replace(qwen3_moe, moe=dataclasses.replace(qwen3_moe.moe, shared_size=512))
    assert "shared experts" in local_family_problem(shared)


def test_train_on_the_local_backend_refuses_before_any_work(cli, tmp_path):
    logs = tmp_path / "logs"
    code, out = cli(
        "train",
        CFG,
        "policy.model_name=MiniMaxAI/MiniMax-M2",
        f"logger.log_dir={logs}",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        "--backend",
        "local",
    )
    assert code == 2, out
    assert "policy.model_name: the local backend does not run this model" in out
    assert "--backend nemo-rl" in out and "Traceback" not in out
    assert not logs.exists() and not (tmp_path / "ckpt").exists()
