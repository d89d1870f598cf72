"""slurm/launch.sh under DRY_RUN=1: nodes and GPUs per node come from one place (issue 36)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TWO_NODES = "examples/configs/nemo_rl_fp8_e2e.yaml"  # cluster.num_nodes: 2


def _launch(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {
        "PATH": "/usr/bin:/bin",
        "DRY_RUN": "1",
        "CONTAINER": "/images/nemo-jetrl.sqsh",
        "ACCOUNT": "acct",
        "PARTITION": "batch",
        # A Python that imports nemo_jetrl (the login node's venv) reads the config.
        "PYTHON": sys.executable,
        "HOME": os.environ.get("HOME", "/tmp"),
    }
    return subprocess.run(
        ["bash", "slurm/launch.sh", *args],
        cwd=REPO,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_config_node_count_reaches_sbatch_and_the_run():
    proc = _launch(TWO_NODES, "grpo.max_num_steps=3")
    assert proc.returncode == 0, proc.stderr
    assert "--nodes=2" in proc.stdout
    assert "cluster.num_nodes=2\\ cluster.gpus_per_node=8" in proc.stdout
    assert "--gres" not in proc.stdout  # only when GRES is set
    assert "HF_TOKEN" in proc.stderr  # Llama is gated: the note says what to export


def test_mismatch_with_the_config_is_refused_naming_both():
    proc = _launch(TWO_NODES, NODES="1")
    assert proc.returncode == 2
    assert "NODES=1 but the config has cluster.num_nodes=2" in proc.stderr
    proc = _launch(TWO_NODES, GPUS_PER_NODE="4")
    assert proc.returncode == 2
    assert "GPUS_PER_NODE=4 but the config has cluster.gpus_per_node=8" in proc.stderr


def test_override_on_the_command_line_sets_both():
    proc = _launch(TWO_NODES, "cluster.num_nodes=1", NODES="1", GRES="gpu:8")
    assert proc.returncode == 0, proc.stderr
    assert "--nodes=1" in proc.stdout and "--gres=gpu:8" in proc.stdout
    assert "cluster.num_nodes=1\\ cluster.gpus_per_node=8" in proc.stdout
