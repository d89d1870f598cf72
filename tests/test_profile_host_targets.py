"""benchmarks/gpu/profile_host.py on CPU: its issue-48 target lines from synthetic rows (the
figures themselves need a GPU), its parser, and its refusal without CUDA."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


@pytest.fixture
def profile_host(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("profile_host")


def _row(layer: str, fwd: float, bwd: float, gpu: float, m: int = 8192) -> dict:
    return {"layer": layer, "M": m, "host_fwd_ms": fwd, "host_bwd_ms": bwd,
            "host_ms": fwd + bwd, "gpu_ms": gpu}  # fmt: skip


def test_host_target_is_met_only_where_fwd_plus_bwd_enqueue_beats_the_gpu(profile_host):
    rows = [_row("qkv_proj", 0.3, 0.4, 0.9), _row("o_proj", 0.3, 0.4, 0.7),
            _row("gate_up_proj", 0.3, 0.3, 1.2), _row("down_proj", 0.2, 0.2, 0.5)]  # fmt: skip
    lines = profile_host.target_lines(rows)
    assert [line.rsplit(": ", 1)[-1].split(" (")[0] for line in lines] == [
        "MET", "NOT MET", "MET", "MET", "NOT MET"]  # fmt: skip
    assert "host 0.700 ms = fwd 0.300 + bwd 0.400 vs GPU 0.700 ms" in lines[1]
    assert lines[-1].endswith("Qwen3-8B all 4 linears: NOT MET (o_proj)")
    assert "NOT MEASURED" in profile_host.target_lines(rows[:3])[-1]
    with_control = dict(rows[1], bf16_host_ms=0.25)  # the control, where it was measured
    assert profile_host.target_lines([with_control])[0].endswith(
        "vs GPU 0.700 ms; torch's BF16 linear on this host 0.250 ms)")  # fmt: skip
    both = dict(with_control, triton_gemm_host_ms=0.45)  # the layer on Triton GEMMs
    assert profile_host.target_lines([both])[0].endswith(
        "torch's BF16 linear on this host 0.250 ms; on Triton GEMMs (no cuBLASLt call) 0.450 ms)")  # fmt: skip
    other = [_row(r["layer"], 0.1, 0.1, 1.0, m=1024) for r in rows]
    assert profile_host.target_lines(other) == [
        "target: Fp8BlockLinear host enqueue (fwd + bwd) < GPU time at 8192 tokens, Qwen3-8B "
        "all 4 linears: NOT MEASURED (run --tokens 8192)"
    ]


def test_shapes_are_qwen3_8b_and_cpu_is_refused(profile_host, capsys):
    shapes = {n: (nn, k) for n, nn, k in profile_host.layer_shapes(profile_host.MODEL)}
    assert shapes == {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096),
                      "gate_up_proj": (24576, 4096), "down_proj": (4096, 12288)}  # fmt: skip
    assert profile_host.build_parser().parse_args([]).tokens == 8192
    if torch.cuda.is_available():
        return
    with pytest.raises(SystemExit) as exc:
        profile_host.main([])
    assert exc.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_python_calls_counts_the_calls_made(profile_host, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def three() -> None:
        for _ in range(3):
            abs_value(-1)

    def abs_value(v: int) -> int:
        return -v if v < 0 else v

    calls, _every = profile_host.python_calls(three)
    assert calls == 4  # three() and 3 x abs_value


def test_the_triton_gemm_host_is_the_same_layer_planned_on_the_triton_backend(
    profile_host, monkeypatch
):
    """`triton_gemm_host_ms`: the layer is built, planned and timed while
    JETRL_FP8_GEMM_BACKEND=triton (forward and backward each behind the sleep), and the
    variable is as it was after (stubs for the layer and the timing: no GPU here)."""
    import os

    monkeypatch.setenv("JETRL_FP8_GEMM_BACKEND", "scaled_mm")
    seen = []

    def calls(w, x, dy, pow2):  # type: ignore[no-untyped-def]
        seen.append(("plan", os.environ["JETRL_FP8_GEMM_BACKEND"], pow2))
        return None, "fwd", "bwd"

    def timed(prepare, iters):  # type: ignore[no-untyped-def]
        seen.append((prepare, os.environ["JETRL_FP8_GEMM_BACKEND"], iters))
        return {"fwd": 0.5, "bwd": 0.25}[prepare]

    monkeypatch.setattr(profile_host, "_fp8_calls", calls)
    monkeypatch.setattr(profile_host, "_behind_sleep_ms", timed)
    args = profile_host.build_parser().parse_args(["--iters", "7", "--no-pow2"])
    assert args.triton_gemm is True
    assert profile_host.triton_gemm_host_ms(None, None, None, args) == 0.75
    assert seen == [("plan", "triton", False), ("fwd", "triton", 7), ("bwd", "triton", 7)]
    assert os.environ["JETRL_FP8_GEMM_BACKEND"] == "scaled_mm"
    assert profile_host.build_parser().parse_args(["--no-triton-gemm"]).triton_gemm is False
