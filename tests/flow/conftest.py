"""Shared by the flow tests that drive the `jetrl` CLI."""

from __future__ import annotations

import pytest

from nemo_jetrl.cli import main


@pytest.fixture(autouse=True)
def _clean_te_scale_env(monkeypatch):
    """Validation warns when the process environment sets TE's scale rule; other tests in the
    same process may have set it (nemo_jetrl.megatron does, on purpose)."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)


@pytest.fixture
def cli(capsys):
    """``cli(*argv) -> (exit code, stdout + stderr)`` of one `jetrl` call."""

    def run(*argv) -> tuple[int, str]:
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out + err

    return run
