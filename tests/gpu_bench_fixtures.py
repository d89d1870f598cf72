"""The `bench` fixture of the benchmark scripts' CPU tests (test_bench_scripts_cpu.py,
test_bench_fp8_dense_cpu.py, test_bench_moe_layer_cpu.py): `bench(NAME)` imports
benchmarks/gpu/NAME.py, that folder on sys.path for the test. A test module takes it with
`from gpu_bench_fixtures import bench_fixture`.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


@pytest.fixture(name="bench")
def bench_fixture(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))

    def load(name: str):
        return importlib.import_module(name)

    return load
