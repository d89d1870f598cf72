"""Shared by the local-run fault tests (tests/runs/test_faults_*.py): the recipe they run and
its warm-start cache, a module-scoped fixture each test module binds by name
(``cache_dir = fault_warm_cache.cache_dir``) so pytest finds it there."""

from __future__ import annotations

from pathlib import Path

import pytest
from local_configs import tiny_cfg

RECIPE = "jetrl"  # the FP8-training recipe: the one whose resume must be exact


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """A warm-start cache filled once, in this process, before any subprocess reads it."""
    d = tmp_path_factory.mktemp("faults_cache")
    from nemo_jetrl.backends.local.setup import LocalRun, resolve_run

    LocalRun(resolve_run(tiny_cfg(RECIPE, tmp_path_factory.mktemp("warm"), d))).close()
    return d
