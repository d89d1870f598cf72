"""``jetrl rehearse`` of a mixture-of-experts config, as a user gets there (the console script, in
subprocesses, in the NeMo-RL tier's environment): NeMo-RL's own Qwen3-30B-A3B GRPO config
(bf16 as shipped) aligned with ``jetrl align``, then rehearsed for two GRPO steps of NeMo-RL's own
``grpo_train`` on CPU with a tiny Qwen3-MoE stand-in (``rehearsal/model.py``). On each tree: jetrl
on v0.7.0 (vLLM 0.20 has no CPU FP8 KV cache), jetrl_kv on main where its vLLM CPU build runs an
FP8 KV cache (``compat.cpu_fp8_kv_cache``; else jetrl), so the MoE refit carries the KV scales too.

One rehearsal per tree (~1-4 min on the 2-core machine); the stand-in's rules and the refit's
expert names are unit-tested in the default suite (test_rehearsal_moe_unit.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nemo_rl, pytest.mark.vllm]

CONFIG = "examples/configs/recipes/llm/grpo-math-qwen3-30ba3b-megatron-tp4-32k.yaml"
# vLLM TP=4 would split each expert's 768 into 192 per rank (not 128-blocks): jetrl align says
# to serve whole experts per rank instead, as a user then does
EP = "policy.generation.vllm_cfg.expert_parallel_size=4"


def _jetrl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "-m", "nemo_jetrl.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _recipe() -> str:
    """jetrl_kv where this tree's vLLM CPU build runs an FP8 KV cache (main's 0.25.1 with
    AVX-512/AMX), else jetrl (v0.7.0's 0.20: never)."""
    from nemo_jetrl.backends.nemo_rl.rehearsal import model as tiny
    from nemo_jetrl.vllm_patch.compat import cpu_fp8_kv_cache

    kv = os.environ.get("JETRL_NEMO_RL_TREE", "v0.7.0") != "v0.7.0"
    return "jetrl_kv" if kv and cpu_fp8_kv_cache(head_size=tiny.BLOCK)[0] else "jetrl"


def test_nemo_rls_qwen3_30b_a3b_config_aligned_to_jetrl_rehearses_ready(tmp_path):
    from nemo_jetrl.backends.nemo_rl.rehearsal import model as tiny

    tree = Path(os.environ.get("JETRL_NEMO_RL_TREE_DIR") or "")
    if not (tree / CONFIG).is_file():
        pytest.skip(f"no NeMo-RL tree with {CONFIG} (JETRL_NEMO_RL_TREE_DIR={str(tree)!r})")
    recipe = _recipe()
    aligned = tmp_path / f"qwen3_30ba3b_{recipe}.yaml"
    proc = _jetrl("align", str(tree / CONFIG), EP, "--recipe", recipe, "-o", str(aligned),
                  cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verdict: ON-POLICY" in proc.stdout
    proc = _jetrl("rehearse", str(aligned), "--workdir", str(tmp_path / "w"), cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert "Qwen/Qwen3-30B-A3B -> 2-layer qwen3_moe stand-in" in out
    from nemo_jetrl.backends.nemo_rl.rehearsal.run import REPLAY_NOTE

    assert REPLAY_NOTE in out  # align turned router replay on; the CPU policy does not replay
    layers, experts = tiny.LAYERS, tiny.EXPERTS
    # vLLM fuses q/k/v: qkv_proj and o_proj per layer; one routed-experts layer per layer
    assert (
        f"kernel serves {2 * layers}/{2 * layers} FP8 linears and {layers}/{layers} FP8 expert "
        f"layers ({layers * experts} experts), refit hook installed"
    ) in out, out
    # per layer, weights and scales of q, k, v, o and of each expert's gate, up and down
    fp8 = layers * (4 + 3 * experts) * 2
    for step in (1, 2):
        held = re.search(rf"step {step}: refit parity held, (\d+) tensors \({fp8} FP8\) ident", out)
        assert held, out[-5000:]
        if recipe == "jetrl_kv":  # the 3 KV scales of each layer ride the same refit
            assert int(held[1]) - fp8 >= 3 * layers
            assert f"step {step}: KV scales: {layers} layers calibrated (q,k,v), identical" in out
    tmpe = re.search(r"train/token_mult_prob_error: step 1: ([\d.]+), step 2: ([\d.]+)", out)
    assert tmpe, out
    # the CPU policy is float32, vLLM's engine block-FP8 experts: close, not bitwise
    assert all(1.0 <= float(v) < 1.2 for v in tmpe.groups())
    assert re.search(r"ready for the cluster \(2 GRPO steps in \d+ s\)", out)
    ckpt = tmp_path / "w" / "checkpoints" / "step_2" / "policy" / "weights"
    assert ckpt.is_dir()
