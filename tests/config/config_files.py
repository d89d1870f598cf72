"""Paths, small helpers and an autouse env fixture the config tests share
(tests/config/test_config*.py). The modules that validate configs import `clean_te_scale_env`.
Not a conftest.py: test modules elsewhere do `from conftest import ...` meaning tests/conftest.py,
and a second conftest module in the same process answers that import in its place."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_jetrl.config import ConfigIssue, errors, load_config, validate

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "configs"
BASE = EXAMPLES / "base" / "grpo_megatron.yaml"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def cfg_with(*overrides: str):
    return load_config(BASE, list(overrides))


def issue_paths(cfg) -> dict[str, list[ConfigIssue]]:
    out: dict[str, list[ConfigIssue]] = {}
    for i in errors(validate(cfg)):
        out.setdefault(i.path, []).append(i)
    return out


@pytest.fixture(autouse=True)
def clean_te_scale_env(monkeypatch):
    """Validation warns when the process environment sets TE's scale rule; other tests in the
    same process may have set it (nemo_jetrl.megatron does, on purpose)."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
