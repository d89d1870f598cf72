"""The mutants `scripts/mutation_check.py` plants, one realistic bug each, with the tests that cover
its file (narrow on purpose: the whole list runs in CI). Each ``old`` text must occur exactly once
in ``file``; when the code changes, update the text here (tests/test_mutation_harness.py says
which mutant lost its code). A mutant that survives is either a gap in the tests (add a test that
fails on it) or provably harmless (set ``equivalent`` to the reason). Tests that read source text
(tests/test_mutation_harness.py) are never listed: a mutant is judged by behaviour only.
The lists live in `mutant_catalog/`, one module per area; this file puts them in order.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutant_catalog import (
    audit,
    benchmarks,
    check_cli,
    ci,
    cluster,
    cluster_launch,
    core,
    engines,
    gpu,
    local_runs,
    model_layouts,
    rl_loss,
    split_gemm,
)

CONTROLS = core.CONTROLS
MUTANTS = [
    *core.MUTANTS,
    *cluster.MUTANTS,
    *cluster_launch.MUTANTS,
    *engines.MUTANTS,
    *audit.MUTANTS,
    *gpu.MUTANTS,
    *split_gemm.MUTANTS,
    *benchmarks.MUTANTS,
    *ci.MUTANTS,
    *local_runs.MUTANTS,
    *check_cli.MUTANTS,
    *rl_loss.MUTANTS,
    *model_layouts.MUTANTS,
]
