"""Test tiers: optional markers skip with a reason when their dependency is absent."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GOLDEN_DIR = Path(os.environ.get("JETRL_GOLDEN_DIR", REPO.parent / "shared" / "golden"))


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _nemo_rl() -> bool:
    # The PyPI `nemo-rl` is an empty placeholder: require the real GRPO entry point.
    return _has("nemo_rl") and _has("nemo_rl.algorithms.grpo")


_TIERS = {
    "gpu": (_cuda, "needs a CUDA GPU (run scripts/run_gpu_tests.sh in the Docker image)"),
    "vllm": (
        lambda: _has("vllm"),
        "needs vLLM (bash scripts/setup_vllm_env.sh, then scripts/test_vllm.sh)",
    ),
    "megatron": (lambda: _has("megatron.core"), "needs megatron-core (pip install '.[megatron]')"),
    "nemo_rl": (_nemo_rl, "needs NeMo-RL (run in the Docker image)"),
    "triton": (lambda: _has("triton"), "needs triton (pip install '.[triton]')"),
}


def pytest_configure(config: pytest.Config) -> None:
    # Triton reads TRITON_INTERPRET when a kernel is first defined, which may happen in any test
    # module that touches the dispatch; set it once for the session on CPU-only machines.
    if not _cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = config.getoption("--runslow") or os.environ.get("JETRL_RUN_SLOW") == "1"
    cache: dict[str, bool] = {}
    for item in items:
        for name, (probe, reason) in _TIERS.items():
            if name in item.keywords:
                if name not in cache:
                    cache[name] = probe()
                if not cache[name]:
                    item.add_marker(pytest.mark.skip(reason=reason))
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --runslow or JETRL_RUN_SLOW=1"))


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    if not (GOLDEN_DIR / "te_golden_seed0.safetensors").is_file():
        pytest.fail(
            f"golden vectors not found in {GOLDEN_DIR}: check out ../shared beside the repo "
            "or set JETRL_GOLDEN_DIR"
        )
    return GOLDEN_DIR
