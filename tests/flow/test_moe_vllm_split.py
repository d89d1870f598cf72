"""FP8 MoE configs whose vLLM rollout splits the experts over ranks (issue 28, flow/support.py):
tensor parallel is accepted where each rank's share of an expert's width is a multiple of 128
(training's FP8 blocks, `vllm_patch.expert_shards`), expert parallel (EP = TP) always; the rest
is refused naming the key and what to set."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_jetrl.config import ConfigError
from nemo_jetrl.flow.pipeline import check_config

E2E = Path(__file__).resolve().parents[2] / "examples" / "configs" / "nemo_rl_fp8_e2e.yaml"
TP = "policy.generation.vllm_cfg.tensor_parallel_size"
EP = "policy.generation.vllm_cfg.expert_parallel_size"
Q235 = "policy.model_name=Qwen/Qwen3-235B-A22B"  # experts of width 1536


@pytest.mark.parametrize(
    "overrides",
    [
        [Q235, f"{TP}=4"],  # 384 per rank = 3 x 128
        [Q235, f"{TP}=2"],
        [Q235, f"{TP}=8", f"++{EP}=8"],  # expert parallel: whole experts per rank
        ["policy.model_name=Qwen/Qwen3-30B-A3B", f"{TP}=2"],  # 768 / 2 = 384
    ],
)
def test_aligned_tp_and_expert_parallel_are_on_policy(overrides):
    c = check_config(str(E2E), [*overrides, "jetrl.vllm_patch=true"])
    assert c.check.on_policy
    assert {b.backend: b.on_policy for b in c.backends}["nemo-rl v0.7.0"]


@pytest.mark.parametrize(
    ("overrides", "key", "needles"),
    [
        (
            [Q235, f"{TP}=8"],
            TP,
            [
                f"{TP}=8 splits each expert's width 1536 into 192 per rank, not a multiple of 128",
                f"Set {EP}=8 (vLLM expert parallel",
                f"or {TP}=4 (width / TP a multiple of 128)",
            ],
        ),
        (
            [Q235, f"{TP}=4", f"++{EP}=8"],
            EP,
            [f"{EP}=8 > {TP}=4 runs vLLM data parallel", f"set {EP}=4"],
        ),
    ],
)
def test_unaligned_tp_and_vllm_data_parallel_refused_by_key(overrides, key, needles):
    with pytest.raises(ConfigError) as exc:
        check_config(str(E2E), [*overrides, "jetrl.vllm_patch=true"])
    msg = str(exc.value)
    assert key in msg and "mixture-of-experts model" in msg
    for needle in needles:
        assert needle in msg, (needle, msg)
