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
from pathlib import Path

import pytest
from rehearsals import QWEN, TREE, assert_ready, rehearse, uni_executor

pytestmark = [pytest.mark.nemo_rl, pytest.mark.vllm]

ONE_TREE = pytest.mark.skipif(
    TREE != "v0.7.0",
    reason="once, on NeMo-RL v0.7.0 (the launch is the same code on both trees up to setup)",
)


def test_a_missing_prompt_file_stops_the_rehearsal_naming_the_key(tmp_path):  # both trees
    proc = rehearse(QWEN / "jetrl.yaml", "+data.default.prompt_file=prompts/missing.txt",
                    workdir=tmp_path / "w")  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "data.default.prompt_file: 'prompts/missing.txt' does not exist" in proc.stderr
    assert "ready for the cluster" not in proc.stdout


@ONE_TREE
def test_our_kernel_disabled_stops_the_rehearsal_before_ray(tmp_path):
    env = {"VLLM_DISABLED_KERNELS": "JetRLFp8BlockLinearKernel"}
    proc = rehearse(QWEN / "jetrl.yaml", workdir=tmp_path / "w", env=env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "VLLM_DISABLED_KERNELS='JetRLFp8BlockLinearKernel' names JetRLFp8BlockLinearKernel" in (
        proc.stderr
    )
    assert "(set by VLLM_DISABLED_KERNELS in the launch environment)" in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout


@ONE_TREE
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


SHIPPED_FP8 = "grpo-llama3.1-8b-instruct-2n8g-megatron-fp8-e2e.yaml"  # NeMo-RL's own, dense


@ONE_TREE
@pytest.mark.timeout(1800)  # three rehearsals in a row (~3 x 170 s idle, more under load)
def test_nemo_rls_shipped_fp8_config_rehearses_as_three_recipes_and_compare_labels_them(
    tmp_path,
):
    """What a NeMo-RL user does with their FP8 config: `jetrl align --recipe R` for bf16,
    fp8_rollout and jetrl, a rehearsal of each, then `jetrl compare` over the three. fp8_rollout
    serves with vLLM's own quantizer through the rehearsal's CPU GEMM stand-in (vLLM has no CPU
    block-FP8 kernel); bf16 and fp8_rollout refit with NeMo-RL's own code, jetrl with our hook."""
    import json

    from nemo_jetrl.cli import main

    shipped = (
        Path(os.environ["JETRL_NEMO_RL_TREE_DIR"]) / "examples/configs/recipes/llm" / SHIPPED_FP8
    )
    recipes = ("bf16", "fp8_rollout", "jetrl")
    procs = {}
    for recipe in recipes:
        off_policy = recipe == "fp8_rollout"  # align writes it, and its check says OFF-POLICY
        cfg = tmp_path / f"{recipe}.yaml"
        assert main(["align", str(shipped), "--recipe", recipe, "-o", str(cfg)]) == int(off_policy)
        extra = ["++jetrl.allow_off_policy=true"] if off_policy else []
        proc = procs[recipe] = rehearse(cfg, *extra, workdir=tmp_path / recipe)
        assert proc.returncode == 0, recipe + proc.stdout[-4000:] + proc.stderr[-4000:]
        assert re.search(r"ready for the cluster \(2 GRPO steps in \d+ s\)", proc.stdout)
    out = {r: proc.stdout for r, proc in procs.items()}
    runs = [str(p) for r in recipes for p in (tmp_path / r / "logs").glob("exp_*")]
    # bf16 and fp8_rollout: NeMo-RL's own refit and vLLM's own quantizer, said so
    for recipe in ("bf16", "fp8_rollout"):
        assert "kernel serves" not in out[recipe]
        assert (
            f"step 2: refit by NeMo-RL's own code (no nemo_jetrl hook for recipe {recipe})"
            in (out[recipe])
        )
    # the GEMM stand-in only where vLLM's own block-FP8 kernel serves, read back from the worker
    assert re.search(r"CPU substitutes in effect: [^\n]*, vllm_block_fp8" + uni_executor() + "\n",
                     out["fp8_rollout"])  # fmt: skip
    for recipe in ("bf16", "jetrl"):
        assert "vllm_block_fp8" not in out[recipe]
    # jetrl: our kernel and hook, parity at both steps, every readiness check
    assert_ready(procs["jetrl"], tmp_path / "jetrl")
    assert main(["compare", *runs, "-o", str(tmp_path / "cmp"), "--no-plots"]) == 0
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    labels = {row["label"] for row in summary["summaries"]}
    assert labels == {"bf16", "fp8_rollout", "jetrl"}, labels


@ONE_TREE
def test_a_crash_in_nemo_rls_setup_exits_1_naming_it_and_does_not_hang(tmp_path):
    """A vLLM engine that cannot start (a typo in ``vllm_kwargs``: vLLM's own TypeError in the
    actor) ends the rehearsal with exit 1 and the cause. NeMo-RL's half-built ``VllmGeneration``
    is released while our Ray still runs: before, its ``__del__`` started a second Ray after
    ours was shut down and waited on it forever."""
    proc = rehearse(QWEN / "jetrl.yaml", "+policy.generation.vllm_kwargs.not_a_vllm_arg=1",
                    workdir=tmp_path / "w")  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert re.search(r"jetrl rehearse: FAILED after \d+ s: \w+", proc.stdout), out[-4000:]
    assert "not_a_vllm_arg" in out
    assert "ready for the cluster" not in proc.stdout
