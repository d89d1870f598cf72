"""docs/nemo_rl_configs.md is current: its section for the tree under test is what
scripts/nemo_rl_config_table.py writes now, and it lists exactly the FP8 GRPO configs NeMo-RL's
own loader finds (issue 26's closing list)."""

from __future__ import annotations

import difflib
import importlib.util
import sys
from pathlib import Path

import pytest
from nemo_rl_grpo_configs import grpo_configs, set_env_placeholders
from nemo_rl_upstream import tree_dir, tree_name

pytestmark = pytest.mark.nemo_rl

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "nemo_rl_config_table.py"
RERUN = f"rerun `.venv/bin/python {SCRIPT.relative_to(REPO)}` and commit docs/nemo_rl_configs.md"


def _script():
    spec = importlib.util.spec_from_file_location("nemo_rl_config_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _fp8(cfg: dict) -> bool:
    """FP8 on some side, read from NeMo-RL's resolved dict (the doc's definition)."""
    pol = cfg["policy"]
    vllm = (pol.get("generation") or {}).get("vllm_cfg") or {}
    fp8_cfg = (pol.get("megatron_cfg") or {}).get("fp8_cfg") or {}
    return (
        vllm.get("precision") == "fp8"
        or str(vllm.get("kv_cache_dtype")).startswith("fp8")
        or fp8_cfg.get("enabled") is True
    )


@pytest.mark.slow
def test_committed_config_table_is_current(monkeypatch):
    table = _script()
    set_env_placeholders(monkeypatch)
    committed = table.sections(table.DOC.read_text()) if table.DOC.is_file() else {}
    assert tree_name() in committed, (
        f"docs/nemo_rl_configs.md has no {tree_name()} section: {RERUN}"
    )
    rows = table.tree_rows(tree_dir())
    configs, _ = grpo_configs(tree_dir())
    theirs = sorted(str(p.relative_to(tree_dir())) for p, cfg in configs if _fp8(cfg))
    assert [r.config for r in rows] == theirs, (
        "the table's FP8 configs differ from NeMo-RL's loader"
    )
    now = table.render_tree(tree_name(), rows)
    old = committed[tree_name()].rstrip("\n") + "\n"
    diff = "\n".join(difflib.unified_diff(old.splitlines(), now.splitlines(), lineterm="", n=0))
    assert now == old, f"docs/nemo_rl_configs.md is stale for {tree_name()}: {RERUN}\n{diff}"
