"""``jetrl rehearse`` of NeMo-RL main's shipped Qwen3.5 FP8 MoE config
(``grpo-qwen3.5-35ba3b-2n8g-megatron-ep16tp2-fp8.yaml``: hybrid attention, gated DeltaNet beside
full attention, MoE with a shared expert) aligned with ``jetrl align --recipe jetrl``, as its
user does, in the NeMo-RL tier: vLLM 0.25.1's CPU engine serves the tiny multimodal Qwen3.5-MoE
stand-in (`rehearsal/hybrid.py`: its CPU gated DeltaNet, state cache float32) and NeMo-RL's
``grpo_train`` runs two steps with our kernel, our refit hook and its parity check.

Skipped, with the reason, only where this tree's vLLM cannot serve Qwen3.5 (NeMo-RL v0.7.0's
vLLM 0.20 has no CPU gated DeltaNet and the config is not in its tree); on main a missing
torchvision (vLLM's Qwen3.5 module imports it; scripts/setup_nemo_rl_env.sh installs it) fails
under CI=true instead of skipping. 50-76 s on the 2-core machine (one vLLM engine).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from rehearsals import assert_ready, rehearse

pytestmark = [pytest.mark.nemo_rl, pytest.mark.vllm, pytest.mark.slow]

SHIPPED = "examples/configs/recipes/llm/grpo-qwen3.5-35ba3b-2n8g-megatron-ep16tp2-fp8.yaml"


def _served_or_skip() -> None:
    """Skip (fail under CI=true for a missing torchvision) unless vLLM serves Qwen3.5 here."""
    from nemo_jetrl.backends.nemo_rl.rehearsal.families import hybrid_serving

    answer = hybrid_serving("qwen3_5_moe_text")  # what `jetrl rehearse` asks, same process
    if answer.can:
        return
    if "torchvision" in answer.why and os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: run scripts/setup_nemo_rl_env.sh (it installs it): {answer.why}")
    pytest.skip(f"this env's vLLM cannot serve Qwen3.5: {answer.why}")


def test_nemo_rls_qwen35_35b_a3b_fp8_config_aligned_to_jetrl_rehearses_ready(tmp_path):
    from nemo_jetrl.backends.nemo_rl.rehearsal import model as tiny
    from nemo_jetrl.cli import main

    shipped = Path(os.environ.get("JETRL_NEMO_RL_TREE_DIR") or "") / SHIPPED
    if not shipped.is_file():
        pytest.skip(f"{SHIPPED} is not in this NeMo-RL tree (main only)")
    _served_or_skip()
    aligned = tmp_path / "qwen35_35ba3b_jetrl.yaml"
    assert main(["align", str(shipped), "--recipe", "jetrl", "-o", str(aligned)]) == 0
    work = tmp_path / "w"
    layers, experts = tiny.LAYERS, tiny.EXPERTS
    # vLLM: layer 0 out_proj (the aligned config keeps the whole GDN in_proj and conv1d BF16:
    # Megatron's one in_proj GEMM), layer 1 qkv_proj and o_proj, each layer's shared expert
    # gate_up and down; one routed-experts layer per layer
    kernel = f"7/7 FP8 linears and {layers}/{layers} FP8 expert layers ({layers * experts} experts)"
    # per layer, weights and scales: out_proj or q, k, v, o; shared gate, up, down; 4 experts'
    # gate, up and down (sent as main's grouped slabs, checked per expert)
    fp8 = 2 * ((1 + 3 + 3 * experts) + (4 + 3 + 3 * experts))
    out = assert_ready(rehearse(aligned, workdir=work), work, fp8=fp8, kernel=kernel)
    assert "Qwen/Qwen3.5-35B-A3B-Base -> 2-layer qwen3_5_moe_text stand-in" in out
    config = (work / "model" / "config.json").read_text()
    assert '"Qwen3_5MoeForConditionalGeneration"' in config  # the class vLLM serves
    # the BF16 tensors checked too: the GDN in_proj pieces (rows of vLLM's fused in_proj_qkvz /
    # in_proj_ba), conv1d, norms, routers, shared-expert gates, embeddings
    for step in (1, 2):
        held = re.search(rf"step {step}: refit parity held, (\d+) tensors \({fp8} FP8\)", out)
        assert int(held[1]) - fp8 >= 4 + 2 * layers, out[-3000:]
