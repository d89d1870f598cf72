"""The recipe reaches NeMo-RL's logged hyperparameters, and `jetrl compare` labels runs by it
(issue 36), through NeMo-RL's REAL classes of the tree under test (v0.7.0 or main 7ea279a).

What runs for real: our ``prepare``/``translate`` of the shipped Qwen3-8B configs, our launch's
merge onto NeMo-RL's own example config, NeMo-RL's ``MasterConfig`` (``extra="allow"``: it
keeps our ``jetrl`` key), ``get_next_experiment_dir`` (one ``exp_NNN`` per launch, the
documented ``runs/<recipe>/exp_*`` layout), its ``Logger`` with TensorBoard on, the two lines
``grpo.setup`` runs (``Logger(master_config.logger)``, ``log_hyperparams(master_config.
model_dump())``), and ``log_metrics`` through our ``JetrlLoggerProxy`` as ``grpo_train`` calls
it; then the ``jetrl compare`` CLI on those directories. Stand-in: the metric values (no GPU
training run), chosen exact in float32.

On 696f711 ``translate`` dropped the ``jetrl:`` section, so no ``jetrl.*`` hparam was logged:
labels ``exp_001 #1``..``#4``, the resumed jetrl job two runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nemo_rl_upstream import with_nemo_rl_defaults

from nemo_jetrl.backends.nemo_rl import launch as nr
from nemo_jetrl.backends.nemo_rl.metrics import JetrlLoggerProxy
from nemo_jetrl.cli import main

pytestmark = pytest.mark.nemo_rl

QWEN = Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_8b_base"
TMPE = {"bf16": 1.0078125, "fp8_rollout": 1.25, "jetrl": 1.015625}


def launch_logged(runs: Path, recipe: str, steps: range, tmpe: dict[int, float], extra=()) -> Path:
    """What one `jetrl train` launch of ``recipe`` with ``logger.log_dir=runs/<recipe>`` logs."""
    from nemo_rl.algorithms.grpo import MasterConfig
    from nemo_rl.utils.logger import Logger, get_next_experiment_dir

    overrides = [*(["jetrl.allow_off_policy=true"] if recipe == "fp8_rollout" else []), *extra]
    plan = nr.prepare(str(QWEN / f"{recipe}.yaml"), overrides).plan
    master = MasterConfig(**with_nemo_rl_defaults(plan.master_config))
    log_dir = get_next_experiment_dir(str(runs / recipe))  # as launch._master_config does
    master.logger.update(
        log_dir=log_dir,
        tensorboard_enabled=True,
        wandb_enabled=False,
        swanlab_enabled=False,
        mlflow_enabled=False,
        monitor_gpus=False,
    )
    master.logger.setdefault("tensorboard", {})
    logger = Logger(master.logger)  # grpo.setup
    logger.log_hyperparams(master.model_dump())  # grpo.setup
    proxy = JetrlLoggerProxy(logger)  # launch._train
    # every launch, resumed or not, logs at step 0: grpo.setup its setup timings (v0.7.0
    # grpo.py :1228), the engine check its kernel metrics (engine_check.py)
    logger.log_metrics({"total_setup_time_s": 60.0}, step=0, prefix="timing/setup")
    if recipe != "bf16":
        proxy.log_metrics({"jetrl/kernel/refit_hook_installed": 1.0}, 0, prefix="")
    for s in steps:
        metrics = {"token_mult_prob_error": tmpe[s], "jetrl/mismatch/k1_kl": tmpe[s] - 1}
        proxy.log_metrics({**metrics, "reward": s / 8}, s, prefix="train")  # grpo_train
    for lg in logger.loggers:
        lg.writer.close()
    return Path(log_dir)


def test_nemo_rl_logs_the_recipe_and_compare_labels_and_joins(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    for r in ("bf16", "fp8_rollout"):
        launch_logged(runs, r, range(1, 5), dict.fromkeys(range(1, 5), TMPE[r]))
    killed = {**dict.fromkeys(range(1, 4), TMPE["jetrl"]), 3: 2.0}  # its step 3 is redone
    e1 = launch_logged(runs, "jetrl", range(1, 4), killed)
    e2 = launch_logged(runs, "jetrl", range(3, 5), dict.fromkeys(range(3, 5), TMPE["jetrl"]))
    assert (e1.name, e2.name) == ("exp_001", "exp_002")

    monkeypatch.chdir(tmp_path)
    dirs = [f"runs/{r}/{p.name}" for r in TMPE for p in sorted((runs / r).glob("exp_*"))]
    rc = main(["compare", *dirs, "-o", "cmp", "--no-plots", "--metric", "token_mult_prob_error"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    summ = json.loads(Path("cmp/summary.json").read_text())["summaries"]
    assert [s["label"] for s in summ] == list(TMPE)
    jet = summ[2]
    assert (jet["steps"], jet["first_step"], jet["last_step"]) == (4, 1, 4)
    assert jet["max"] == TMPE["jetrl"]  # exp_001's step 3 (2.0) replaced by exp_002's
    assert "joined: jetrl: one run resumed across 2 directories" in cap.out


def test_run_name_reaches_nemo_rls_hparams(tmp_path):
    from nemo_jetrl.runs.logs import read_run

    d = launch_logged(
        tmp_path / "runs", "jetrl", range(1, 2), {1: 1.0}, ["+jetrl.run_name=jetrl-lr3e-7"]
    )
    run = read_run(d)
    assert run.hparams["jetrl.recipe"] == "jetrl"
    assert run.hparams["jetrl.run_name"] == "jetrl-lr3e-7"
    assert run.label == "jetrl-lr3e-7"
