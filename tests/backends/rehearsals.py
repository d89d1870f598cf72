"""Running ``jetrl rehearse`` as a user does (the console entry, a subprocess, from the work
dir's parent) and what every rehearsal that ends "ready for the cluster" must have printed and
written; shared by the NeMo-RL tier's rehearsal tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QWEN = REPO / "examples" / "configs" / "qwen3_8b_base"
TREE = os.environ.get("JETRL_NEMO_RL_TREE", "v0.7.0")


def uni_executor() -> str:
    """The substitutes line's tail where this tier's vLLM CPU platform turns NeMo-RL's one-worker
    ``uni`` executor into ``mp`` (0.20: the rehearsal keeps ``uni``, the engine runs in the actor
    as on a GPU); "" from 0.25, whose platform keeps it itself with multiprocessing off."""
    import vllm

    from nemo_jetrl.vllm_patch.compat import release

    return ", uni_executor" if release(vllm.__version__) < (0, 25, 0) else ""


def rehearse(config: Path, *overrides: str, workdir: Path, env: dict | None = None):
    cmd = [sys.executable, "-m", "nemo_jetrl.cli", "rehearse", str(config), *overrides,
           "--workdir", str(workdir)]  # fmt: skip
    full = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    # from the work dir's parent, as a user anywhere (the repo's nemo_jetrl.egg-info, a build
    # artifact, would shadow the entry points on the path; this process's are what count)
    cwd = Path(workdir).parent
    return subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=900)


def assert_ready(
    proc, work: Path, *, fp8: int = 28, prompt_file: bool = True, kernel: str = "8/8 FP8 linears"
) -> str:
    """A rehearsal of one of our recipes (our kernel and refit hook in the engine) that is ready
    for the cluster: exit 0, NeMo-RL's prompt resolved in its own tree (where the config keeps
    grpo_math's ``prompt_file``), the engine check line, the substitutes read back from the vLLM
    worker, parity at both steps, the mismatch per step, the checkpoint and the kernel metric.
    Returns stdout."""
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:] + proc.stderr[-5000:]
    if prompt_file:
        assert re.search(r"path data\.default\.prompt_file: examples/prompts/cot\.txt -> \S+"
                         r"/nemo-rl/[^/]+/examples/prompts/cot\.txt", out), out  # fmt: skip
    assert f"kernel serves {kernel}, refit hook installed" in out
    # every vLLM line runs the engine in NeMo-RL's actor (no spawned worker, so no second
    # fp8_patches: NeMo-RL's init_fp8 ran in that process)
    assert re.search(r"vLLM worker 0: CPU substitutes in effect: sleep_mode, device, bind_numa, "
                     r"report_device_id, ipc_buffer, bf16_weights" + uni_executor() + r"\n",
                     out), out  # fmt: skip
    for step in (1, 2):
        assert re.search(rf"step {step}: refit parity held, \d+ tensors \({fp8} FP8\) identical",
                         out), out[-5000:]  # fmt: skip
    tmpe = re.search(r"train/token_mult_prob_error: step 1: ([\d.]+), step 2: ([\d.]+)", out)
    assert tmpe, out[-5000:]
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
    return out
