"""`jetrl compare` on the cluster layout docs/cluster.md documents: runs/<recipe>/exp_NNN.

Three recipes' NeMo-RL runs (bf16, fp8_rollout, jetrl; the jetrl job cut at its time limit and
resubmitted, so it wrote exp_001 and exp_002) are written as NeMo-RL's ``Logger`` writes them with
TensorBoard on: a new ``exp_NNN`` per launch (``get_next_experiment_dir``), a ``SummaryWriter`` on
``<exp>/tensorboard``, ``log_hyperparams(master_config.model_dump())`` = ``add_hparams`` of the
flattened config, ``log_metrics(m, step, prefix)`` = ``add_scalar(f"{prefix}/{name}")``. The
master config is our real ``translate`` of the shipped example configs (the keys NeMo-RL's
``MasterConfig`` keeps: tests/backends/test_nemo_rl_run_identity.py runs NeMo-RL's own classes).

On the old code the hparams carried no recipe (translate dropped the ``jetrl:`` section), so the
labels came out ``exp_001 #1``..``#4`` and the resumed jetrl job was two runs; and
``jetrl.run_name`` was refused as an unknown key.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from nemo_jetrl.backends.nemo_rl import launch as nr
from nemo_jetrl.cli import main
from nemo_jetrl.runs.logs import RunDataWarning
from nemo_jetrl.runs.report import DEFAULT_METRICS

REPO = Path(__file__).resolve().parents[2]
QWEN = REPO / "examples" / "configs" / "qwen3_8b_base"
# values exact in float32 (TensorBoard stores simple_value as float32)
TMPE = {"bf16": 1.0078125, "fp8_rollout": 1.25, "jetrl": 1.015625}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunDataWarning)
        yield


def nemo_rl_flatten(d: dict[str, Any], sep: str = ".") -> dict[str, Any]:
    """NeMo-RL's ``flatten_dict`` (nemo_rl/utils/logger.py, v0.7.0 and main: lists expanded)."""
    out: dict[str, Any] = {}

    def walk(d: dict[str, Any], parent: str = "") -> None:
        for k, v in d.items():
            key = f"{parent}{sep}{k}" if parent else k
            if isinstance(v, dict):
                walk(v, key)
            elif isinstance(v, list):
                for i, item in enumerate(v):
                    if isinstance(item, dict):
                        walk(item, f"{key}{sep}{i}")
                    else:
                        out[f"{key}{sep}{i}"] = item
            else:
                out[key] = v

    walk(d)
    return out


def next_experiment_dir(base: Path) -> Path:
    """NeMo-RL's ``get_next_experiment_dir``: exp_{max id + 1:03d}."""
    ids = [int(m.group(1)) for p in base.glob("exp_*") if (m := re.search(r"exp_(\d+)", p.name))]
    d = base / f"exp_{max(ids, default=0) + 1:03d}"
    d.mkdir(parents=True)
    return d


def launch_run(runs: Path, recipe: str, steps: range, tmpe: dict[int, float], overrides=()) -> Path:
    """One `jetrl train ... logger.log_dir=runs/<recipe>` launch as NeMo-RL's logger records it."""
    from torch.utils.tensorboard import SummaryWriter

    extra = ["jetrl.allow_off_policy=true"] if recipe == "fp8_rollout" else []
    plan = nr.prepare(str(QWEN / f"{recipe}.yaml"), [*extra, *overrides]).plan
    log_dir = next_experiment_dir(runs / recipe)
    w = SummaryWriter(log_dir=str(log_dir / "tensorboard"))
    w.add_hparams(nemo_rl_flatten(plan.master_config), {})
    # every launch, resumed or not, logs at step 0 (NeMo-RL's grpo.setup timings)
    w.add_scalar("timing/setup/total_setup_time_s", 60.0, 0)
    if plan.master_config["logger"]["monitor_gpus"]:  # on in our base configs
        # NeMo-RL's RayGpuMonitorLogger: ray/* at step = seconds since the launch (every 10 s)
        for t in range(0, 300, 10):
            w.add_scalar("ray/node.0.gpu.0.utilization", 0.9, t)
            w.add_scalar("ray/ray_step", t, t)
    for s in steps:
        train = {"token_mult_prob_error": tmpe[s], "reward": s / 8}
        for name, v in train.items():
            w.add_scalar(f"train/{name}", v, s)
        w.add_scalar("jetrl/mismatch/k1_kl", (tmpe[s] - 1) / 4, s)  # JetrlLoggerProxy: no prefix
    w.close()
    time.sleep(0.01)
    return log_dir


def test_compare_labels_by_recipe_and_joins_the_resumed_job(tmp_path, capsys, monkeypatch):
    runs = tmp_path / "runs"
    for r in ("bf16", "fp8_rollout"):
        launch_run(runs, r, range(1, 7), dict.fromkeys(range(1, 7), TMPE[r]))
    # jetrl: killed after step 4 (last checkpoint: step 3), resubmitted: resumes at step 4
    first = {s: TMPE["jetrl"] for s in range(1, 5)}
    first[4] = 3.0  # the killed job's step 4, redone by the resubmitted job
    e1 = launch_run(runs, "jetrl", range(1, 5), first)
    e2 = launch_run(runs, "jetrl", range(4, 7), dict.fromkeys(range(4, 7), TMPE["jetrl"]))
    assert (e1.name, e2.name) == ("exp_001", "exp_002")

    # docs/cluster.md: jetrl compare runs/bf16/exp_* runs/fp8_rollout/exp_* runs/jetrl/exp_*
    monkeypatch.chdir(tmp_path)
    dirs = [str(p.relative_to(tmp_path)) for r in TMPE for p in sorted((runs / r).glob("exp_*"))]
    out = tmp_path / "cmp"
    rc = main(["compare", *dirs, "-o", str(out), "--no-plots"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    summ = json.loads((out / "summary.json").read_text())["summaries"]
    assert [s["label"] for s in summ] == [r for r in TMPE for _ in DEFAULT_METRICS]
    rows = {(s["label"], s["metric"]): s for s in summ}
    tm = rows[("jetrl", "train/token_mult_prob_error")]
    # one run, steps 1-6; step 4 from exp_002 (exp_001's 3.0 replaced)
    assert (tm["steps"], tm["first_step"], tm["last_step"]) == (6, 1, 6)
    assert tm["max"] == TMPE["jetrl"] and tm["mean"] == TMPE["jetrl"]
    assert tm["run_dir"] == "runs/jetrl/exp_001+runs/jetrl/exp_002"
    for r, v in TMPE.items():
        assert rows[(r, "jetrl/mismatch/k1_kl")]["last"] == pytest.approx((v - 1) / 4)
    joined = [ln for ln in cap.out.splitlines() if ln.startswith("joined:")]
    assert joined == [
        "joined: jetrl: one run resumed across 2 directories of runs/jetrl: exp_001 steps 1-4; "
        "exp_002 steps 4-6 (steps 4-4 taken from exp_002, not the earlier logs)"
    ]
    assert "#" not in cap.out and "exp_001 " not in cap.out.split("joined:")[0]


def test_a_rerun_from_scratch_is_another_run(tmp_path):
    """Same recipe, second launch starting at step 1 again: not a resume, two runs."""
    from nemo_jetrl.runs.report import compare_runs

    runs = tmp_path / "runs"
    a = launch_run(runs, "jetrl", range(1, 4), dict.fromkeys(range(1, 4), 1.0))
    b = launch_run(runs, "jetrl", range(1, 4), dict.fromkeys(range(1, 4), 1.5))
    res = compare_runs([a, b], metrics=["token_mult_prob_error"])
    assert [s.label for s in res.summaries] == ["jetrl (exp_001)", "jetrl (exp_002)"]
    assert "joined" not in res.table


def test_run_name_is_an_accepted_key_and_labels_the_run(tmp_path):
    from nemo_jetrl.runs.report import compare_runs

    runs = tmp_path / "runs"
    a = launch_run(runs, "jetrl", range(1, 3), {1: 1.0, 2: 1.0}, ["+jetrl.run_name=jetrl-seed7"])
    plan = nr.prepare(str(QWEN / "jetrl.yaml"), ["+jetrl.run_name=jetrl-seed7"]).plan
    assert plan.master_config["jetrl"] == {"recipe": "jetrl", "run_name": "jetrl-seed7"}
    res = compare_runs([a], metrics=["token_mult_prob_error"])
    assert res.summaries[0].label == "jetrl-seed7"
