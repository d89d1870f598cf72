"""benchmarks/gpu/profile_kernels.py on CPU: its grouping of device activities and summary line
from synthetic activities (a profile needs a GPU), its workloads, and its refusal without CUDA."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


@pytest.fixture
def profile_kernels(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("profile_kernels")


def test_activities_group_per_kernel_per_call_largest_first(profile_kernels):
    long = "sm90_xmma_gemm_" + "x" * 200  # a cuBLAS name: cut to the table's width
    acts = [("quantize_rowcol_kernel", 30.0), (long, 100.0), ("quantize_rowcol_kernel", 30.0),
            (long, 110.0), ("Memset (Device)", 2.0), ("quantize_rowcol_kernel", 40.0)]  # fmt: skip
    rows = profile_kernels.kernel_rows(acts, steps=2)
    assert [r["kernel"] for r in rows][1:] == ["quantize_rowcol_kernel", "Memset (Device)"]
    assert len(rows[0]["kernel"]) == profile_kernels.NAME_WIDTH and rows[0]["kernel"].endswith(
        "..."
    )
    assert [(r["us"], r["launches"]) for r in rows] == [(105.0, 1.0), (50.0, 1.5), (1.0, 0.5)]
    assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-12 and rows[0]["share"] == 210.0 / 312.0
    assert profile_kernels.kernel_rows([], steps=3) == []


def test_report_names_the_ratio_and_the_largest_kernel(profile_kernels, monkeypatch, capsys):
    fake = {"ours": [("split_gemm_kernel", 80.0), ("quantize_kernel", 20.0)],
            "bf16": [("nvjet_gemv", 150.0)]}  # fmt: skip
    monkeypatch.setattr(profile_kernels._common, "device_events", lambda fn, steps: fn())
    line = profile_kernels.report(
        "decode x", {k: (lambda v=v: v) for k, v in fake.items()}, steps=1, top=5
    )
    assert line == ("profile decode x: ours 100.0 us, bf16 150.0 us of device time (bf16 / ours "
                    "1.50); ours' largest: split_gemm_kernel")  # fmt: skip
    out = capsys.readouterr().out
    assert "## decode x: ours, 100.0 us" in out and "nvjet_gemv" in out


def test_workloads_cover_the_missed_targets_and_cpu_is_refused(profile_kernels, capsys):
    labels = [label for label, _ in profile_kernels.workloads(profile_kernels.WORKLOADS)]
    assert labels[0].startswith("moe Qwen3-30B-A3B 2048") and labels[-1].startswith("linear")
    assert sum(label.startswith("decode") for label in labels) == 4  # M 1, 64 x two backends
    assert [lb for lb, _ in profile_kernels.workloads(["linear"])] == [labels[-1]]
    if torch.cuda.is_available():
        return
    with pytest.raises(SystemExit) as exc:
        profile_kernels.main(["--only", "moe"])
    assert exc.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
