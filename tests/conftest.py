"""Test tiers: optional markers skip with a reason when their dependency is absent."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The golden vectors ship in the repository (a copy of shared/golden; test_golden_copy checks
# it against the shared original where that is checked out beside the repo).
REPO_GOLDEN_DIR = REPO / "tests" / "data" / "golden"
SHARED_GOLDEN_DIR = REPO.parent / "shared" / "golden"
GOLDEN_DIR = Path(os.environ.get("JETRL_GOLDEN_DIR", REPO_GOLDEN_DIR))
# NeMo-RL's real source trees (v0.7.0, main-*) for the tiers that import them.
NEMO_RL_UPSTREAM_VAR = "JETRL_NEMO_RL_UPSTREAM"
NEMO_RL_UPSTREAM = Path(
    os.environ.get(NEMO_RL_UPSTREAM_VAR, REPO.parent / "shared" / "upstream" / "nemo-rl")
)
NEMO_RL_UPSTREAM_HOWTO = (
    f"set {NEMO_RL_UPSTREAM_VAR}=DIR to a folder holding NeMo-RL checkouts named v0.7.0 and "
    "main-<sha> (git clone https://github.com/NVIDIA-NeMo/RL DIR/v0.7.0 && git -C DIR/v0.7.0 "
    "checkout v0.7.0), or check out ../shared beside the repository"
)


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
    "nemo_rl": (
        _nemo_rl,
        "needs NeMo-RL (bash scripts/setup_nemo_rl_env.sh, then scripts/test_nemo_rl.sh TREE)",
    ),
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
            f"golden vectors not found in {GOLDEN_DIR}: they ship in tests/data/golden; "
            "unset JETRL_GOLDEN_DIR or point it at a directory that holds them"
        )
    return GOLDEN_DIR


def nemo_rl_upstream_trees() -> list[Path]:
    """NeMo-RL source trees found (each holds ``nemo_rl/``), newest name last."""
    if not NEMO_RL_UPSTREAM.is_dir():
        return []
    return sorted(d for d in NEMO_RL_UPSTREAM.iterdir() if (d / "nemo_rl").is_dir())


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    trees = nemo_rl_upstream_trees()
    if trees:
        names = ", ".join(t.name for t in trees)
        line = f"NeMo-RL upstream source: {NEMO_RL_UPSTREAM} ({names})"
    else:
        line = f"NeMo-RL upstream source: not found at {NEMO_RL_UPSTREAM}; {NEMO_RL_UPSTREAM_HOWTO}"
    terminalreporter.write_line(line)


# -- fixtures shared across test folders (one conftest: sub-folder conftest.py files would
#    shadow this module for tests that import it by name) ---------------------------------


@pytest.fixture
def clean_te_env(monkeypatch):
    """Validation warns when the process environment sets TE's scale rule; other tests in the
    same process may have set it (nemo_jetrl.megatron does, on purpose)."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)


@pytest.fixture
def cli(capsys, clean_te_env):
    """``cli(*argv) -> (exit code, stdout + stderr)`` of one `jetrl` call."""
    from nemo_jetrl.cli import main

    def run(*argv) -> tuple[int, str]:
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out + err

    return run


@pytest.fixture(scope="module")
def gpt():
    """One real megatron-core GPTModel on CPU per test module (tests/megatron_shims.py)."""
    from megatron_shims import build_gpt, megatron_cpu

    with megatron_cpu():
        model = build_gpt()
        model.eval()
        yield model
