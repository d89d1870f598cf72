"""`jetrl check` judges GRPO configs: a NeMo-RL SFT, DPO, RM, evaluation, distillation or PPO
config (its own top-level section, no ``grpo:``) was called ON-POLICY (exit 0) with no rollout
to judge; it is refused (exit 2) naming why, by check, align and train alike. On NeMo-RL's own
configs of both trees."""

from __future__ import annotations

import pytest
from conftest import NEMO_RL_UPSTREAM

UPSTREAM = NEMO_RL_UPSTREAM  # honours $JETRL_NEMO_RL_UPSTREAM (the mutation check's copies)
TREES = ("v0.7.0", "main-7ea279a")
NOT_GRPO = "not a GRPO config"

pytestmark = pytest.mark.skipif(not UPSTREAM.is_dir(), reason="NeMo-RL's source absent")


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize(
    ("name", "key", "why"),
    [
        ("sft.yaml", "sft", "samples no rollout"),
        ("dpo.yaml", "dpo", "samples no rollout"),
        ("rm.yaml", "rm", "no rollout"),
        ("xtoken_off_policy_distillation.yaml", "distillation", "samples no rollout at all"),
        ("distillation_math.yaml", "distillation", "samples the student with policy.generation"),
        ("ppo_math_1B.yaml", "ppo", "ppo.async_ppo"),
        ("evals/eval.yaml", "eval", "trains nothing"),
    ],
)
def test_configs_of_other_nemo_rl_programs_are_refused_by_name(cli, tree, name, key, why):
    code, out = cli("check", UPSTREAM / tree / "examples" / "configs" / name)
    assert code == 2 and "Traceback" not in out, out
    assert f"  - {key}: {NOT_GRPO}: a NeMo-RL " in out and f"top-level `{key}:`, no `grpo:`" in out
    assert why in out and "GRPO configs only" in out
    assert "verdict:" not in out


def test_align_and_train_refuse_them_too(cli, tmp_path):
    sft = UPSTREAM / "main-7ea279a" / "examples" / "configs" / "sft.yaml"
    code, out = cli("align", sft, "-o", tmp_path / "out.yaml")
    assert code == 2 and f"sft: {NOT_GRPO}" in out and not (tmp_path / "out.yaml").exists()
    code, out = cli("train", sft, f"logger.log_dir={tmp_path / 'run'}")
    assert code == 2 and f"sft: {NOT_GRPO}" in out and not (tmp_path / "run").exists()


@pytest.mark.parametrize("tree", TREES)
def test_grpo_configs_still_get_a_verdict(cli, tree):
    code, out = cli("check", UPSTREAM / tree / "examples" / "configs" / "grpo_math_1B.yaml")
    assert code in (0, 1) and "verdict: " in out and NOT_GRPO not in out, out[-600:]


def test_a_grpo_config_without_generation_is_refused(cli):
    """NeMo-RL's run_grpo.py asserts policy.generation is set: no rollout, no verdict."""
    path = UPSTREAM / "main-7ea279a" / "examples" / "configs" / "grpo_math_1B.yaml"
    code, out = cli("check", path, "policy.generation=null")
    assert code == 2 and "policy.generation: null: a GRPO run samples its rollouts" in out, out


@pytest.mark.parametrize(
    "path",
    [
        "v0.7.0/examples/nemo_gym/prefetch_super_all_envs.yaml",
        "main-7ea279a/examples/nemo_gym/prefetch_omni_envs.yaml",
        "main-7ea279a/examples/nemo_gym/prefetch_ultra_all_envs.yaml",
    ],
)
def test_a_file_without_policy_or_grpo_is_refused(cli, path):
    """NeMo-Gym's prefetch configs (only ``env:``, read by a Docker build) were called ON-POLICY:
    the checker judged its generic model's defaults. No ``policy:`` and no ``grpo:``: exit 2."""
    code, out = cli("check", UPSTREAM / path)
    assert code == 2 and "  - policy: missing, and no `grpo:` either" in out, out
    assert "(env:)" in out and "verdict:" not in out
    assert "of None" not in out  # the model-name note says "not given"
