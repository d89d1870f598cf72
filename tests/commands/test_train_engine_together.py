"""`jetrl train` with ``jetrl.local.rollout_engine=vllm`` where vLLM does not import, and another
config error: the missing vLLM was named only after the config was mended (bad-input review,
session 41); now both at once, before any work. vLLM is made unimportable here
(``sys.modules["vllm"] = None``), so the test means the same in the vLLM environment."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "examples/configs/local/jetrl.yaml"


def test_a_missing_vllm_is_named_with_the_configs_other_errors(cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    log = tmp_path / "run"
    base = [
        "train",
        LOCAL,
        f"logger.log_dir={log}",
        "jetrl.local.rollout_engine=vllm",
        "--backend",
        "local",
        "--no-progress",
    ]
    code, out = cli(*base, "policy.generation.temperature=-1")
    assert code == 2, out
    assert "policy.generation.temperature" in out, out
    assert "jetrl.local.rollout_engine: rollout_engine=vllm needs vLLM" in out, out
    assert not log.exists()  # before any work
    code, out = cli(*base[:3], "jetrl.local.rollout_engine=hf", *base[4:], "grpo.seed=-1")
    assert code == 2 and "grpo.seed" in out and "needs vLLM" not in out, out  # control: hf
