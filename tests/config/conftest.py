"""Fixtures of the config tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _clean_te_scale_env(monkeypatch):
    """Validation warns when the process environment sets TE's scale rule; other tests in the
    same process may have set it (nemo_jetrl.megatron does, on purpose)."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
