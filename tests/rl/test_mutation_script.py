"""scripts/mutation_check.py stays applicable: every mutation still finds its code, once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_mutation_applies_to_the_current_code():
    spec = importlib.util.spec_from_file_location(
        "mutation_check", REPO / "scripts" / "mutation_check.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert len(mod.MUTATIONS) == 14
    for name, alternatives in mod.MUTATIONS.items():
        hits = [
            rel
            for rel, old, new in alternatives
            if (REPO / rel).exists() and (REPO / rel).read_text().count(old) == 1 and old != new
        ]
        assert hits[:1], f"{name}: its code is gone; update scripts/mutation_check.py"
