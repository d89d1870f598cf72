"""``policy.precision`` is the training dtype NeMo-RL's policy workers map to a torch dtype
(Megatron and DTensor/automodel setups); another value (``fp7``, or ``fp8`` meant as FP8
training, which is jetrl.recipe's) passed `jetrl check` and would fail at the workers' setup
(bad-input review, session 41)."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import NEMO_RL_UPSTREAM, nemo_rl_upstream_trees

from nemo_jetrl.config.schema import POLICY_PRECISIONS

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "examples/configs/qwen3_8b_base/jetrl.yaml"


def _dtype_keys(source: str) -> set[str]:
    """The string keys of each ``{"float32": torch.float32, ...}`` map in ``source``."""
    maps = re.findall(r"=\s*\{([^{}]*torch\.float32[^{}]*)\}", source)
    return {k for m in maps for k in re.findall(r'"(\w+)"\s*:\s*torch\.', m)}


def test_ours_are_the_dtypes_each_nemo_rl_tree_maps():
    trees = nemo_rl_upstream_trees()
    assert len(trees) >= 2, f"NeMo-RL's trees not found at {NEMO_RL_UPSTREAM}"
    for tree in trees:
        for rel in ("nemo_rl/models/megatron/setup.py", "nemo_rl/models/automodel/setup.py"):
            keys = _dtype_keys((tree / rel).read_text())
            assert keys == set(POLICY_PRECISIONS), (tree.name, rel, keys)


def test_another_precision_is_refused_naming_the_key(cli):
    for bad in ("fp7", "fp8"):
        code, out = cli("check", CLUSTER, f"policy.precision={bad}")
        assert code == 2 and f"policy.precision: got '{bad}'" in out, out
        assert "bfloat16, float16, float32" in out, out
        # where FP8 is set instead (a user writing fp8 here meant FP8 training)
        assert "FP8 training is policy.megatron_cfg.fp8_cfg.enabled" in out, out
        assert "jetrl.recipe" in out, out
    code, out = cli("check", CLUSTER, "policy.precision=float32")  # control
    assert code == 0, out
