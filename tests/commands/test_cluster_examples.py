"""The cluster-facing examples a new user runs first (issue 36): the one-node smoke config passes
`jetrl check` and fits one node; the example launcher, the image and the GPU test script do not
carry the day-one traps (a `uv run` that syncs our pyproject into NeMo-RL's venv, a venv link
NeMo-RL's forced rebuild cannot remove, a `docker run` without NeMo-RL's shared-memory flags)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nemo_jetrl.cli import main
from nemo_jetrl.config import load_config

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "examples" / "configs" / "smoke" / "qwen3_1.7b_jetrl.yaml"


@pytest.fixture(autouse=True)
def _clean_te_scale_env(monkeypatch):
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)


def test_smoke_config_checks_on_policy(capsys):
    assert main(["check", str(SMOKE)]) == 0
    out = capsys.readouterr().out
    assert "recipe: jetrl" in out and "verdict: ON-POLICY" in out


def test_smoke_config_is_one_node_and_short():
    cfg = load_config(SMOKE)
    assert cfg.cluster.num_nodes == 1 and cfg.cluster.gpus_per_node == 8
    mc = cfg.policy.megatron_cfg
    tp, pp, cp = (
        mc.tensor_model_parallel_size,
        mc.pipeline_model_parallel_size,
        mc.context_parallel_size,
    )
    assert 8 % (tp * pp * cp) == 0
    dp = 8 // (tp * pp * cp)
    grpo = cfg.grpo
    assert grpo.num_prompts_per_step * grpo.num_generations_per_prompt == (
        cfg.policy.train_global_batch_size
    )
    assert cfg.policy.train_global_batch_size % dp == 0
    assert grpo.max_num_steps <= 20 and cfg.policy.max_total_sequence_length <= 2048
    assert cfg.data.train.dataset_name == "GSM8K"


def test_example_launcher_has_no_uv_run_line():
    text = (REPO / "examples" / "run_grpo_jetrl.py").read_text()
    assert not re.search(r"^\s*uv run\b", text, re.M)
    assert "python examples/run_grpo_jetrl.py --config" in text


def test_image_makes_no_venv_link_and_records_its_commit():
    text = (REPO / "docker" / "Dockerfile").read_text()
    assert not re.search(r"^\s*ln -s", text, re.M)
    assert "ARG JETRL_COMMIT" in text and '> "${JETRL_DIR}/COMMIT"' in text


def test_gpu_test_script_docker_line_has_nemo_rl_flags():
    text = (REPO / "scripts" / "run_gpu_tests.sh").read_text()
    docker = text[text.index("docker run") :].split("\n#\n")[0]
    for flag in ("--ipc=host", "--shm-size=", "--ulimit memlock=-1"):
        assert flag in docker, flag
    assert "--container-image=" in text  # the pyxis way


def test_gpu_test_script_runs_the_end_to_end_grpo_test_once():
    """Tier 1's marker (the Megatron venv, which can import NeMo-RL) had also selected the
    `nemo_rl` + `gpu` end-to-end GRPO run that tier 4 runs: GPU minutes spent twice."""
    import subprocess
    import sys

    text = (REPO / "scripts" / "run_gpu_tests.sh").read_text()
    found = re.findall(r'^run_tier "([^"]+)" "\$\w+" -m (?:"([^"]+)"|(\S+))', text, re.M)
    tiers = {name: quoted or bare for name, quoted, bare in found}
    assert set(tiers) == {"megatron+gpu", "vllm", "nemo_rl"}, tiers
    e2e = "test_end_to_end_two_grpo_steps_in_docker"
    target = "tests/backends/test_nemo_rl_backend.py"
    picked = {}
    for name, marks in tiers.items():
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marks, target],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout
        picked[name] = e2e in out
    assert picked == {"megatron+gpu": False, "vllm": False, "nemo_rl": True}
