"""benchmarks/gpu/bench_moe_layer.py's issue-35 target line (MET / NOT MET), on made-up rows: no
timing is claimed here, only what the line says for given figures."""

from __future__ import annotations

import importlib
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


def test_moe_target_is_met_only_at_every_token_count_against_grouped_bf16(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    module = importlib.import_module("bench_moe_layer")
    assert module.TARGET_TOKENS == (64, 256, 2048, 8192) and module.BAR_SPEEDUP == 1.30

    def row(tokens, ours, bf16, impl="torch._grouped_mm", model="Qwen3-30B-A3B"):
        return {"model": model, "tokens": tokens, "ours_ms": ours, "bf16_torch_ms": bf16,
                "bf16_torch_impl": impl}  # fmt: skip

    good = [row(t, 1.0, 1.31) for t in module.TARGET_TOKENS]
    assert module.target_summary(good).endswith(": MET")
    slow = [*good[:3], row(8192, 1.0, 1.2)]
    assert module.target_summary(slow).endswith("NOT MET (8192 1.20x)")
    assert "NOT MET (2048 not run)" in module.target_summary(good[:2] + good[3:])
    loop = [*good[:1], row(256, 1.0, 9.0, impl="per-expert loop (x)"), *good[2:]]
    assert "256 BF16 reference is not torch._grouped_mm" in module.target_summary(loop)
    other = [row(t, 1.0, 9.0, model="DeepSeek-V3") for t in module.TARGET_TOKENS]
    assert "NOT MET (64 not run; 256 not run" in module.target_summary(other)
    untimed = [*good[:3], row(8192, None, 1.3)]
    assert module.target_summary(untimed).endswith("NOT MET (8192 not timed)")
