"""Paths and small helpers the config tests share (tests/config/test_config*.py)."""

from __future__ import annotations

from pathlib import Path

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
