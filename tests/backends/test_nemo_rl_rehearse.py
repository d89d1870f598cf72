"""``jetrl rehearse`` as a user runs it (the console script, in a subprocess, in the NeMo-RL tier's
environment): the launch of ``jetrl train --backend nemo-rl`` for two GRPO steps of NeMo-RL's
own ``grpo_train`` on CPU (real Ray, NeMo-RL's worker groups and vLLM workers, our plugins and
refit hook in them), and the launch's refusals before Ray, each naming its cause.

What the rehearsal replaces, and why, is its own business (nemo_jetrl/backends/nemo_rl/rehearsal/,
docs/rehearsal.md); these tests hold it to its output: the engine check line, refit parity at
every step, the mismatch per step, the checkpoint, ``ready for the cluster``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nemo_rl, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
QWEN = REPO / "examples" / "configs" / "qwen3_8b_base"


def rehearse(config: Path, *overrides: str, workdir: Path, env: dict | None = None):
    cmd = [sys.executable, "-m", "nemo_jetrl.cli", "rehearse", str(config), *overrides,
           "--workdir", str(workdir)]  # fmt: skip
    full = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    # from the work dir's parent, as a user anywhere (the repo's nemo_jetrl.egg-info, a build
    # artifact, would shadow the entry points on the path; this process's are what count)
    cwd = Path(workdir).parent
    return subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def jetrl_rehearsal(tmp_path_factory):
    """One rehearsal of the jetrl recipe (~150 s), read by the tests below."""
    work = tmp_path_factory.mktemp("jetrl") / "w"
    return rehearse(QWEN / "jetrl.yaml", workdir=work), work


def test_rehearsal_of_the_jetrl_recipe_is_ready_for_the_cluster(jetrl_rehearsal):
    proc, work = jetrl_rehearsal
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    # every resolved path, NeMo-RL's prompt from its own tree
    assert re.search(r"path data\.default\.prompt_file: examples/prompts/cot\.txt -> \S+"
                     r"/nemo-rl/[^/]+/examples/prompts/cot\.txt", out), out  # fmt: skip
    assert "kernel serves 8/8 FP8 linears, refit hook installed" in out
    # the CPU substitutes, read back from the vLLM worker (not from Ray's forwarded logs)
    # (fp8_patches: NeMo-RL's init_fp8 again where vLLM spawned its worker: 0.20, not 0.25)
    assert re.search(r"vLLM worker 0: CPU substitutes in effect: sleep_mode, device, bind_numa, "
                     r"report_device_id, ipc_buffer, bf16_weights(, fp8_patches)?\n", out), out  # fmt: skip
    for step in (1, 2):
        assert re.search(rf"step {step}: refit parity held, \d+ tensors \(\d+ FP8\) identical", out)
    tmpe = re.search(r"train/token_mult_prob_error: step 1: ([\d.]+), step 2: ([\d.]+)", out)
    assert tmpe, out
    # the CPU policy is float32, vLLM's engine block-FP8: close, not bitwise
    assert all(1.0 <= float(v) < 1.2 for v in tmpe.groups())
    assert re.search(r"ready for the cluster \(2 GRPO steps in \d+ s\)", out)
    ckpt = work / "checkpoints" / "step_2"
    assert (ckpt / "training_info.json").is_file() and (ckpt / "policy" / "weights").is_dir()
    from nemo_jetrl.runs.logs import read_run

    (exp,) = (work / "logs").glob("exp_*")
    scalars = read_run(exp).scalars
    assert scalars["jetrl/kernel/fp8_linears_on_our_kernel"].values == (1.0,)
    assert scalars["train/token_mult_prob_error"].steps == (1, 2)


def test_a_missing_prompt_file_stops_the_rehearsal_naming_the_key(tmp_path):  # both trees
    proc = rehearse(QWEN / "jetrl.yaml", "+data.default.prompt_file=prompts/missing.txt",
                    workdir=tmp_path / "w")  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "data.default.prompt_file: 'prompts/missing.txt' does not exist" in proc.stderr
    assert "ready for the cluster" not in proc.stdout


@pytest.mark.skipif(
    os.environ.get("JETRL_NEMO_RL_TREE", "v0.7.0") != "v0.7.0", reason="once, on v0.7.0"
)
def test_our_kernel_disabled_stops_the_rehearsal_before_ray(tmp_path):
    env = {"VLLM_DISABLED_KERNELS": "JetRLFp8BlockLinearKernel"}
    proc = rehearse(QWEN / "jetrl.yaml", workdir=tmp_path / "w", env=env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "VLLM_DISABLED_KERNELS='JetRLFp8BlockLinearKernel' names JetRLFp8BlockLinearKernel" in (
        proc.stderr
    )
    assert "(set by VLLM_DISABLED_KERNELS in the launch environment)" in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout


@pytest.mark.skipif(
    os.environ.get("JETRL_NEMO_RL_TREE", "v0.7.0") != "v0.7.0", reason="once, on v0.7.0"
)
def test_our_plugin_entry_point_removed_stops_the_rehearsal_naming_it(tmp_path):
    """The vLLM workers' Python without our kernel's entry point (a venv rebuilt without
    nemo_jetrl, or an install whose metadata lost it): a shadowing dist-info first on the path
    holds our other entry points only."""
    from importlib.metadata import distribution

    shadow = tmp_path / "shadow"
    info = shadow / "nemo_jetrl-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(distribution("nemo_jetrl").read_text("METADATA") or "")
    eps = (distribution("nemo_jetrl").read_text("entry_points.txt") or "").splitlines()
    kept = [line for line in eps if not line.startswith("nemo_jetrl =")]
    assert len(kept) == len(eps) - 1  # the kernel's entry point is the one removed
    (info / "entry_points.txt").write_text("\n".join(kept) + "\n")
    path = os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])
    proc = rehearse(QWEN / "jetrl.yaml", workdir=tmp_path / "w", env={"PYTHONPATH": path})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "the vllm.general_plugins entry point 'nemo_jetrl' is not installed" in proc.stderr
    assert "NRL_FORCE_REBUILD_VENVS" in proc.stderr  # what to do about it


ONE_TREE = pytest.mark.skipif(
    os.environ.get("JETRL_NEMO_RL_TREE", "v0.7.0") != "v0.7.0",
    reason="once, on NeMo-RL v0.7.0 (the launch is the same code on both trees up to setup)",
)


@ONE_TREE
def test_rehearsal_of_the_bf16_recipe_then_compare_labels_both(jetrl_rehearsal, tmp_path):
    from nemo_jetrl.cli import main

    proc = rehearse(QWEN / "bf16.yaml", workdir=tmp_path / "w")
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    # NeMo-RL's own refit into vLLM's own kernels: no engine check, no hook, said so
    assert "kernel serves" not in out
    assert "step 2: refit by NeMo-RL's own code (no nemo_jetrl hook for recipe bf16)" in out
    assert "ready for the cluster" in out
    runs = [
        str(p) for w in (tmp_path / "w", jetrl_rehearsal[1]) for p in (w / "logs").glob("exp_*")
    ]
    assert main(["compare", *runs, "-o", str(tmp_path / "cmp"), "--no-plots"]) == 0
    import json

    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    labels = {row["label"] for row in summary["summaries"]}
    assert labels == {"bf16", "jetrl"}, labels


@ONE_TREE
def test_a_recipe_on_vllms_own_fp8_kernel_is_refused_naming_why(tmp_path):
    proc = rehearse(QWEN / "fp8_rollout.yaml", "jetrl.allow_off_policy=true",
                    workdir=tmp_path / "w")  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "vLLM's own kernel, which vLLM's CPU build does not have" in proc.stderr
