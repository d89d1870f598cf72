"""`bench_moe_layer`'s issue-48 parts on CPU: the grouped GEMM shape each row names, ``--tiles``
(ours timed and bit-checked under each forced shape; Triton's interpreter, timing stubbed: no
time is claimed) and the prefill target's MET / NOT MET line from literal times."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from nemo_jetrl.fp8 import experts, finite_flags, grouped_tiles, triton_grouped

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
TINY = dict(hidden=256, inter=128, experts=8, top_k=2)


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("bench_moe_layer")


def _row(model: str, tokens: int, ours: float, bf16: float, tile_ms=None, ok=None) -> dict:
    row = {"model": model, "tokens": tokens, "ours_ms": ours, "bf16_torch_ms": bf16}
    row |= {"bf16_torch_impl": "torch._grouped_mm", "tile": "p128 (128x128, ...)"}
    if tile_ms is not None:
        row |= {"tile_ms": tile_ms, "tile_bitwise_equal": ok}
    return row


def test_prefill_target_needs_both_models_at_both_counts(bench):
    assert bench.PREFILL_MODELS == ("Qwen/Qwen3-30B-A3B", "deepseek-ai/DeepSeek-V3")
    assert bench.PREFILL_TOKENS == (2048, 8192) and bench.BAR_SPEEDUP == 1.30
    rows = [_row(m, t, 1.0, 1.3) for m in ("Qwen3-30B-A3B", "DeepSeek-V3") for t in (2048, 8192)]
    line = bench.prefill_summary(rows)
    assert line.startswith("target (issue 48, prefill, eager): Qwen3-30B-A3B, DeepSeek-V3 >= 1.30x")
    assert " MET (" in line and "DeepSeek-V3 8192 1.30x [p128]" in line
    rows[3] = _row("DeepSeek-V3", 8192, 1.0, 1.29)
    assert "NOT MET" in bench.prefill_summary(rows)
    line = bench.prefill_summary(rows[:3])
    assert "NOT MET" in line and "DeepSeek-V3 8192 not run" in line
    rows[3] = _row("DeepSeek-V3", 8192, 1.0, 1.29, {"p64": 0.8, "g128": 0.5}, {"p64": True})
    # g128 was faster but changed the bits: never named the fastest
    assert "DeepSeek-V3 8192 1.29x [p128; fastest p64 1.61x]" in bench.prefill_summary(rows)
    rows[3]["bf16_torch_impl"] = "per-expert loop (no _grouped_mm)"
    assert "DeepSeek-V3 8192 n/a" in bench.prefill_summary(rows)


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
def test_tiles_are_timed_and_bit_checked_at_the_prefill_counts(bench, monkeypatch):
    monkeypatch.setenv(experts.ENV_GROUPED_BACKEND, "triton")
    monkeypatch.delenv(grouped_tiles.ENV_ROWS_TILE, raising=False)
    seen: list[tuple] = []
    used: list[str] = []
    real = triton_grouped.rows_tile

    def spy(m: int, n_exp: int) -> str:
        used.append(real(m, n_exp))
        return used[-1]

    def stub(fn, **_kw):  # each fn run once; no time is claimed
        used.clear()
        fn()
        seen.append(tuple(used))
        return 1.0

    monkeypatch.setattr(triton_grouped, "rows_tile", spy)

    monkeypatch.setattr(bench._common, "bench_ms", stub)
    monkeypatch.setattr(bench, "vllm_fn", lambda *a: (None, "no vLLM in this test"))
    monkeypatch.setattr(bench._moe_report, "PREFILL_TOKENS", (8,))  # the sweep and the record
    shape = bench.MoeShape("Qwen/Qwen3-30B-A3B", **TINY)
    layer = bench.make_layer(shape, "cpu", 0, True)
    args = bench.build_parser().parse_args(["--tokens", "8", "--tiles", "p128", "p64"])
    skipped: list[str] = []
    row = bench.run_row(shape, layer, 8, args, skipped)
    finite_flags._FLAGS.clear()
    assert row["tile"] == "d64 (64x128, 4 warps, 3 stages, one tile/program)"  # 16 rows
    assert row["bitwise_equal"] and row["tile_bitwise_equal"] == {"p128": True, "p64": True}
    assert row["tile_ms"] == {"p128": 1.0, "p64": 1.0}
    # the shapes each timed fn's two GEMMs ran: ours, the BF16 reference, the forced shapes
    assert seen == [("d64", "d64"), (), ("p128", "p128"), ("p64", "p64")]
    assert "tile" in bench.COLUMNS and bench.RECORD_VERSION == 2
    rec = bench.record([row], "cpu", args, skipped)
    assert rec["prefill_target"]["tokens"] == [8]  # patched above
    assert rec["args"]["tiles"] == ["p128", "p64"]
    plain = bench.run_row(shape, layer, 16, args, [])  # not a prefill count: no sweep
    assert "tile_ms" not in plain and "tile_bitwise_equal" not in plain
    finite_flags._FLAGS.clear()
    assert torch.isfinite(torch.tensor(row["speedup"]))


def test_tiles_sweep_names_every_shape_but_the_spilling_one(bench):
    """``--tiles sweep`` (the GPU call's bench_moe_tiles step) times every grouped GEMM shape
    except p64t3 (120-152 bytes spilled at its 168-register cap: the sm_90 census, 2026-11-29)."""
    args = bench.build_parser().parse_args(["--tiles", "p64", "sweep"])
    assert bench.chosen_tiles(args.tiles) == ["p64", "d64", "p128", "g128", "p128t", "p64t"]
    assert bench.chosen_tiles(["g128"]) == ["g128"]
    assert set(bench.SWEEP_TILES) == set(grouped_tiles.ROWS_TILES) - {"p64t3"}
