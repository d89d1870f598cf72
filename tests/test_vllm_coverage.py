"""tests/vllm_coverage.py (which vLLM tiers run which vLLM-tier test) against the real collection.

The vLLM tier's paths are collected in a subprocess of this environment (no vLLM here, so
nothing is deselected) with a plugin that records each test's markers; `check_map` must find
nothing wrong: every entry names an existing module and matches a collected test, every test the
map or a marker deselects runs on a line scripts/test.sh's default JETRL_VLLM_VERSIONS runs, and
the map's lines and paths are the scripts'. Planted gaps must be reported.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import vllm_coverage
from conftest import REPO
from vllm_coverage import check_map, decide, untiered_vllm_tests

_DUMP = """
import json, os
def pytest_collection_finish(session):
    recs = []
    for item in session.items:
        mark = item.get_closest_marker("vllm_versions")
        recs.append({"nodeid": item.nodeid, "markers": sorted({m.name for m in item.iter_markers()}),
                     "vllm_versions": list(mark.args) if mark else None})
    with open(os.environ["JETRL_COVERAGE_DUMP"], "w") as f:
        json.dump(recs, f)
"""


def ci_lines() -> tuple[str, ...]:
    text = (REPO / "scripts" / "test.sh").read_text()
    (default,) = re.findall(r"JETRL_VLLM_VERSIONS:-([0-9. ]+)\}", text)
    return tuple(".".join(v.split(".")[:2]) for v in default.split())


def tier_paths() -> tuple[str, ...]:
    text = (REPO / "scripts" / "test_vllm.sh").read_text()
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("tests/")]
    return tuple(p for ln in lines for p in ln.split() if p.startswith("tests/"))


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("coverage")
    (tmp / "jetrl_coverage_dump.py").write_text(_DUMP)
    env = dict(os.environ, PYTHONPATH=str(tmp), JETRL_COVERAGE_DUMP=str(tmp / "items.json"))
    env["JETRL_VLLM_ALL_VERSIONS"] = "1"  # collect everything, whatever this env has
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    cmd += ["-p", "jetrl_coverage_dump", *tier_paths()]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = json.loads((tmp / "items.json").read_text())
    assert len(recs) > 100, len(recs)  # the whole tier, not a stray selection
    return recs


def test_the_map_matches_the_tier_and_every_test_runs_on_a_ci_line(records):
    assert check_map(records, ci_lines(), tier_paths(), REPO) == []


def test_each_ci_line_keeps_the_tests_that_reach_its_version_branches(records):
    """What each line runs by the map: 0.32 everything; 0.20 the engine modules that reach a
    version branch (compat.py, moe_versions.py, the CPU table's rows)."""
    runs = {line: set() for line in ci_lines()}
    for r in records:
        found = decide(r["nodeid"], set(r["markers"]), r["vllm_versions"])
        for line in runs:
            if found is None or line in found[0]:
                runs[line].add(r["nodeid"].partition("::")[0])
    assert {r["nodeid"].partition("::")[0] for r in records} - runs["0.32"] == set()
    must_on_020 = {  # a version branch each: registry entry / KV scales / KV dtype / MoE / TP
        "tests/vllm_patch/test_vllm_engine.py",
        "tests/vllm_patch/test_vllm_kernel.py",
        "tests/vllm_patch/test_vllm_guard.py",
        "tests/vllm_patch/test_vllm_kv_cpu.py",
        "tests/vllm_patch/test_vllm_kv_cpu_ops.py",
        "tests/vllm_patch/test_vllm_snapshot.py",
        "tests/vllm_patch/test_vllm_cpu_gemm.py",
        "tests/vllm_patch/test_vllm_moe.py",
        "tests/vllm_patch/test_vllm_moe_shared.py",
        "tests/vllm_patch/test_vllm_moe_shards.py",
        "tests/vllm_patch/test_vllm_moe_shards_refused.py",
        "tests/backends/test_local_vllm.py",
        "tests/backends/test_local_vllm_moe.py",
    }
    assert must_on_020 - runs["0.20"] == set()


def test_planted_gaps_are_reported(records, monkeypatch):
    real = vllm_coverage.COVERAGE
    first = real[0]
    planted = {  # each replaces the first entry
        "no such module": replace(first, module="tests/vllm_patch/test_gone.py"),
        "matches no collected test": replace(first, pattern=r"^test_renamed_away$"),
        "none of which CI runs": replace(first, lines=("0.25",)),
        "no why": replace(first, why=" "),
    }
    for needle, entry in planted.items():
        monkeypatch.setattr(vllm_coverage, "COVERAGE", (entry, *real[1:]))
        problems = check_map(records, ci_lines(), tier_paths(), REPO)
        assert any(needle in p for p in problems), (needle, problems)
    monkeypatch.setattr(vllm_coverage, "COVERAGE", real)
    assert any(
        "deselected on every line CI runs" in p
        for p in check_map(records, ("0.20", "0.25"), tier_paths(), REPO)
    )  # a CI without the 0.32 tier: the tests the map runs there only would run nowhere
    assert any(
        "are not scripts/test.sh's default" in p
        for p in check_map(records, ("0.32",), tier_paths(), REPO)
    )


def test_every_vllm_marked_test_runs_in_some_tier(tmp_path):
    """A test marked vllm outside the vLLM tier's paths, with no NeMo-RL or GPU mark, is skipped
    by the default suite (no vLLM there) and collected by no tier: CI never runs it (how
    tests/runs/test_faults_stale_rollout_vllm.py sat out session 40's CI runs)."""
    assert untiered_vllm_tests(REPO, tier_paths()) == []
    planted = tmp_path / "tests" / "runs" / "test_planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(
        "import pytest\n"
        "pytestmark = [pytest.mark.vllm, pytest.mark.vllm_versions('0.32', why='x')]\n"
        "def test_a(): pass\n"
        "@pytest.mark.gpu\ndef test_on_gpu(): pass\n"
        "class TestB:\n    @pytest.mark.nemo_rl\n    def test_c(self): pass\n"
        "    def test_d(self): pass\n"
    )
    (tmp_path / "tests" / "test_fn.py").write_text(
        "import pytest\n@pytest.mark.vllm\ndef test_e(): pass\ndef test_f(): pass\n"
    )
    assert untiered_vllm_tests(tmp_path, tier_paths()) == [
        "tests/runs/test_planted.py::test_a",
        "tests/runs/test_planted.py::TestB::test_d",
        "tests/test_fn.py::test_e",
    ]
    assert untiered_vllm_tests(tmp_path, ("tests/runs", "tests/test_fn.py")) == []
