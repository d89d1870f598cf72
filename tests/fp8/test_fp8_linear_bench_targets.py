"""benchmarks/gpu/bench_fp8_linear.py's issue-35 target lines, judged on made-up rows (CPU).

The timings themselves need a GPU; what runs here is the verdict logic: MET only when every
linear of both models was measured at 8192 tokens and each reaches the bar, NOT MET naming the
rows short of it, NOT MEASURED when the run did not cover them.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("bench_fp8_linear")


def _rows(bench, **over):
    rows = []
    for model in bench.MODELS:
        for name, n, k in bench.layer_shapes(model):
            row = {"model": model.split("/")[-1], "layer": name, "M": 8192, "N": n, "K": k,
                   "speedup": 1.5, "host_ms": 0.5, "gpu_ms": 1.0, "launches": 9.0,
                   "graphed_speedup": 1.35, "bf16_ms": 1.35, "bf16_graphed_ms": 1.3}  # fmt: skip
            row.update(over.get(name, {}))
            rows.append(row)
    return rows


def test_all_targets_met(bench):
    lines = bench.target_summary(_rows(bench))
    assert len(lines) == 4 and all(line.endswith(": MET") for line in lines), lines


def test_each_target_names_the_rows_short_of_it(bench):
    rows = _rows(bench, o_proj={"speedup": 0.46, "host_ms": 3.6, "gpu_ms": 1.1, "launches": 38.0,
                                "graphed_speedup": 1.2, "bf16_graphed_ms": 1.3})  # fmt: skip
    lines = bench.target_summary(rows)
    assert all("NOT MET" in line for line in lines), lines
    assert "Llama-3.1-8B o_proj 0.46x" in lines[0] and "Qwen3-8B-Base o_proj" in lines[0]
    assert "host 3.60 ms vs GPU 1.10 ms" in lines[1] and "38 launches" in lines[2]
    # the layer in CUDA graphs (graph_linear): eager BF16 over graphed FP8, and BF16's own gain
    assert "in CUDA graphs (graph_linear) fwd+bwd >= 1.3x BF16" in lines[3]
    assert "Llama-3.1-8B o_proj 1.20x (1.04x for BF16 graphed itself)" in lines[3]
    assert "qkv_proj" not in " ".join(lines)
    # host time equal to the GPU's is not below it: the GPU would wait
    even = bench.target_summary(_rows(bench, down_proj={"host_ms": 1.0, "gpu_ms": 1.0}))[1]
    assert even.endswith("NOT MET (Llama-3.1-8B down_proj host 1.00 ms vs GPU 1.00 ms; "
                         "Qwen3-8B-Base down_proj host 1.00 ms vs GPU 1.00 ms)"), even  # fmt: skip


def test_partial_runs_are_not_measured(bench):
    rows = [r for r in _rows(bench) if r["model"].startswith("Qwen")]
    assert all("NOT MEASURED" in line for line in bench.target_summary(rows))
    rows = _rows(bench)
    for r in rows:
        r["M"] = 4096
    assert all("NOT MEASURED" in line for line in bench.target_summary(rows))


def test_a_failed_capture_is_its_rows_text_and_the_run_goes_on(bench, capsys):
    """`graph_linear` has never run on a GPU: where it fails (here: CPU tensors, refused) the
    ``graphed_*`` columns read "failed", the line says so, and the eager figures stand."""
    import torch

    w, x = torch.randn(128, 256).bfloat16(), torch.randn(64, 256).bfloat16()
    got = bench.graphed_figures(w, x, torch.randn(64, 128).bfloat16(), True, 1.0, None)
    assert set(got.values()) == {"failed"} and "graphed_speedup" in got
    assert "# graph_linear failed for [64, 256] x [128, 256]: ValueError: graph_linear" in (
        capsys.readouterr().out
    )
    rows = _rows(bench, o_proj=got)
    line = bench.target_summary(rows)[3]
    assert "Llama-3.1-8B o_proj graph_linear failed" in line and "NOT MET" in line
    assert bench.target_summary(rows)[0].endswith(": MET")  # the eager targets unaffected
