"""`jetrl compare` where torch cannot be imported (issue 46): the light venv on a cluster login
node (docs/cluster.md) that users run it in right after the jobs.

The run directories are made here, with torch, by the project's own makers: NeMo-RL-shaped
``runs/<recipe>/exp_NNN`` logs (`test_compare_recipes.launch_run`: NeMo-RL's SummaryWriter
layout and hparams, one job resumed across two directories) and the local backend's `RunWriter`
directories (`test_compare.make_runs`). ``jetrl compare`` then runs in a child Python whose
import system refuses ``torch`` and every ``torch.*`` module (a meta-path finder ahead of the
others) and records each attempt. On the old code `runs/report.py` imported `rl/metrics.py`,
which imports torch at module level: ModuleNotFoundError, exit 1.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from test_compare import make_runs
from test_compare_recipes import TMPE, launch_run

from nemo_jetrl.runs.logs import RunDataWarning
from nemo_jetrl.runs.writer import RunWriter

# Runs `jetrl`'s entry point (pyproject: jetrl = "nemo_jetrl.cli:main") with torch unimportable;
# writes {"rc", "torch_in_sys_modules", "torch_imports_tried"} to $JETRL_NO_TORCH_REPORT.
NO_TORCH_MAIN = textwrap.dedent(
    """
    import importlib.abc, json, os, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        tried = []

        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                self.tried.append(name)
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, NoTorch())
    from nemo_jetrl.cli import main

    try:
        rc = main(sys.argv[1:])
    except SystemExit as exc:
        rc = exc.code
    with open(os.environ["JETRL_NO_TORCH_REPORT"], "w") as f:
        json.dump(
            {"rc": rc, "torch_in_sys_modules": "torch" in sys.modules,
             "torch_imports_tried": NoTorch.tried},
            f,
        )
    sys.exit(rc)
    """
)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunDataWarning)
        yield


def compare_without_torch(cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``jetrl compare ARGS`` in a child Python that cannot import torch: (process, report)."""
    report = cwd / "no_torch_report.json"
    report.unlink(missing_ok=True)
    env = {**os.environ, "JETRL_NO_TORCH_REPORT": str(report), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH_MAIN, "compare", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.is_file(), f"exit {proc.returncode}, no report:\n{proc.stderr[-3000:]}"
    return proc, json.loads(report.read_text())


def test_compare_nemo_rl_runs_without_torch(tmp_path):
    """docs/cluster.md section 6: three recipes' NeMo-RL logs, the jetrl job resubmitted."""
    runs = tmp_path / "runs"
    for r in ("bf16", "fp8_rollout"):
        launch_run(runs, r, range(1, 5), dict.fromkeys(range(1, 5), TMPE[r]))
    launch_run(runs, "jetrl", range(1, 3), dict.fromkeys(range(1, 3), TMPE["jetrl"]))
    launch_run(runs, "jetrl", range(3, 5), dict.fromkeys(range(3, 5), TMPE["jetrl"]))
    dirs = [str(p.relative_to(tmp_path)) for r in TMPE for p in sorted((runs / r).glob("exp_*"))]
    assert len(dirs) == 4

    proc, rep = compare_without_torch(tmp_path, *dirs, "-o", "cmp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rep == {"rc": 0, "torch_in_sys_modules": False, "torch_imports_tried": []}
    rows = [ln.split()[:2] for ln in proc.stdout.splitlines() if ln.split()[:1] in (["bf16"],
            ["fp8_rollout"], ["jetrl"])]  # fmt: skip
    assert ["fp8_rollout", "train/token_mult_prob_error"] in rows
    assert {r[0] for r in rows} == set(TMPE)
    assert "joined: jetrl: one run resumed across 2 directories" in proc.stdout
    summ = json.loads((tmp_path / "cmp" / "summary.json").read_text())["summaries"]
    tm = {s["label"]: s for s in summ if s["metric"] == "train/token_mult_prob_error"}
    assert {k: v["last"] for k, v in tm.items()} == TMPE
    assert tm["jetrl"]["steps"] == 4
    assert (tmp_path / "cmp" / "train_token_mult_prob_error.png").is_file()


def test_compare_local_backend_runs_without_torch(tmp_path):
    a, b = make_runs(tmp_path)  # RunWriter dirs: a labelled fp8_rollout by config.yaml
    proc, rep = compare_without_torch(tmp_path, a.name, b.name, "-o", "cmp", "--no-plots")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rep == {"rc": 0, "torch_in_sys_modules": False, "torch_imports_tried": []}
    labels = {ln.split()[0] for ln in proc.stdout.splitlines() if "train/" in ln}
    assert labels == {"fp8_rollout", "run_b"}


def jsonl_run(root: Path) -> Path:
    """A run whose TensorBoard lacks the mismatch metrics its train_data jsonl can give."""
    run = root / "jsonl_run"
    with RunWriter(run, config={"jetrl": {"recipe": "jetrl"}}) as w:
        w.log_scalars(1, {"reward": 1.0}, prefix="train")
        w.log_train_data(
            1,
            [
                {
                    "generation_logprobs": [0.0, -math.log(2), -1.0],
                    "prev_logprobs": [0.0, 0.0, -1.0],
                    "token_loss_mask": [0, 1, 1],
                    "sample_loss_mask": 1,
                    "rewards": 1.0,
                }
            ],
        )
    return run


def test_recompute_without_torch_warns_or_is_refused_when_asked_for(tmp_path):
    """Recomputing from train_data jsonl is torch maths: by default the logged metrics are
    compared and the missing ones named with a warning; ``--recompute always`` is exit 2."""
    run = jsonl_run(tmp_path)
    proc, rep = compare_without_torch(tmp_path, run.name, "-o", "cmp", "--no-plots")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rep["torch_in_sys_modules"] is False
    assert "jetrl" in proc.stdout.split()  # labelled by its recipe
    warn = [ln for ln in proc.stderr.splitlines() if "needs torch" in ln]
    assert len(warn) == 1, proc.stderr
    assert "train/token_mult_prob_error" in warn[0] and "--recompute never" in warn[0]

    proc, rep = compare_without_torch(
        tmp_path, run.name, "-o", "cmp", "--recompute", "never", "--force"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rep["torch_imports_tried"] == [] and "needs torch" not in proc.stderr

    proc, rep = compare_without_torch(
        tmp_path, run.name, "-o", "cmp", "--recompute", "always", "--force"
    )
    assert proc.returncode == 2 and rep["rc"] == 2
    assert "Traceback" not in proc.stderr
    assert "jetrl compare: error:" in proc.stderr and "'torch'" in proc.stderr


def test_static_metric_names_are_mismatch_metrics_keys():
    """`rl.metric_names` (torch-free) lists `mismatch_metrics`' tags in its order."""
    import torch

    from nemo_jetrl.rl import metric_names as names
    from nemo_jetrl.rl.metrics import mismatch_metrics

    one = torch.zeros(1, 1)
    assert names.metric_names() == list(mismatch_metrics(one, one, torch.ones(1, 1)))
