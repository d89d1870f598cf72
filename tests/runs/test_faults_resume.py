"""Fault injection on local runs (issue 17), resuming: a torn latest checkpoint resumes from the one
before it, no usable checkpoint is exit 2 (never a silent fresh start), ``--resume`` without a
checkpoint restarts the run it finds, a resume takes the config's learning rate and refuses another
recipe, and a refused validation refit counts once across a resume. Real runs and files, the
shared tiny configs (tests/local_configs.py). The run directory's lock and ``kill -9`` during a
save: tests/runs/test_faults_run_dirs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import fault_warm_cache
from fault_warm_cache import RECIPE
from local_configs import EXAMPLES, TINY_OVERRIDES, tiny_cfg

from nemo_jetrl.backends.local import checkpoint as ckpt
from nemo_jetrl.backends.local.loop import Hooks, resolve_run, run_local
from nemo_jetrl.cli import main
from nemo_jetrl.config import ConfigError
from nemo_jetrl.errors import UserError

cache_dir = fault_warm_cache.cache_dir  # the module-scoped warm-start cache (a fixture)


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory, cache_dir) -> Path:
    d = tmp_path_factory.mktemp("two") / "run"
    run_local(resolve_run(tiny_cfg(RECIPE, d, cache_dir)), progress=False, log=print)
    return d


@pytest.mark.parametrize(
    "damage", ["truncate state.pt", "truncate model.safetensors", "legacy truncate state.pt"]
)
def test_torn_latest_checkpoint_resumes_from_previous(damage, tmp_path, cache_dir, two_step_run):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    ck = run / "checkpoints"
    good = {k: v.clone() for k, v in ckpt.load_checkpoint(ck / "step_2")[0].items()}  # mmap
    name = damage.split()[-1]
    target = ck / "step_2" / name
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    if damage.startswith("legacy"):  # a checkpoint from before manifests: loading must fail
        (ck / "step_2" / ckpt.MANIFEST_FILE).unlink()
    # a fresh start would mix with these checkpoints: refused, naming --resume
    with pytest.raises(UserError, match="--resume"):
        run_local(resolve_run(tiny_cfg(RECIPE, run, cache_dir)), progress=False, log=print)
    msgs: list[str] = []
    res = run_local(
        resolve_run(tiny_cfg(RECIPE, run, cache_dir)), resume=True, progress=False, log=msgs.append
    )
    text = "\n".join(msgs)
    why = "does not load" if damage.startswith("legacy") else f"{name} is "
    assert f"skipping {ck / 'step_2'}: " in text and why in text, text
    assert f"resumed from {ck / 'step_1'}" in text
    assert res.first_step == 1 and res.last_step == 2
    redone, _ = ckpt.load_checkpoint(ck / "step_2")  # redone, verified, equal to the original
    assert all(torch.equal(good[k], redone[k]) for k in good)
    assert ckpt.verify_checkpoint(ck / "step_2") == []


def test_no_usable_checkpoint_is_exit_2_not_a_fresh_start(tmp_path, two_step_run, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    for _, d in ckpt.list_checkpoints(run / "checkpoints"):
        (d / ckpt.STATE_FILE).write_bytes(b"torn")
    rc = main(
        [
            *("train", str(EXAMPLES / f"{RECIPE}.yaml"), *TINY_OVERRIDES),
            *(f"jetrl.local.cache_dir={tmp_path / 'cache'}", f"logger.log_dir={run}"),
            *("--backend", "local", "--no-progress", "--resume"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "no usable checkpoint" in err and "Traceback" not in err, err
    assert "step_2: state.pt is 4 bytes" in err and "step_1: state.pt is 4 bytes" in err, err
    assert [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")] == [1, 2]  # untouched
    assert not (tmp_path / "cache").exists()  # refused before any work (no warm start)


# ------------------------------------------------- --resume where no checkpoint was ever written


def test_resume_without_a_checkpoint_restarts_the_run_it_finds(tmp_path, cache_dir):
    """A job script that always passes --resume, its first job killed before any save: the
    next job restarts that run in place (one run id, the old steps purged, their train data
    aside), not a second run mixed into the same directory. A run that finished, or that
    logged a step it checkpointed (its checkpoints are elsewhere), is not restarted: exit 2."""
    from nemo_jetrl.runs.logs import read_run, run_ids

    run = tmp_path / "run"
    off = ("checkpointing.enabled=false", "grpo.val_period=0")
    # the first job: step 1 logged, then "killed" (it never saved: checkpointing off)
    run_local(resolve_run(tiny_cfg(RECIPE, run, cache_dir, *off, "grpo.max_num_steps=1")),
              progress=False)  # fmt: skip
    (first_id,) = run_ids(run)
    msgs: list[str] = []
    res = run_local(
        resolve_run(tiny_cfg(RECIPE, run, cache_dir, *off)),
        resume=True,
        progress=False,
        log=msgs.append,
    )
    assert f"restarting run {first_id} from step 0" in "\n".join(msgs)
    assert res.first_step == 0 and res.last_step == 2
    assert run_ids(run) == (first_id,)
    data = read_run(run)
    assert data.scalars["train/reward"].steps == (1, 2) and data.train_data_steps == (1, 2)
    assert len(list((run / "superseded").glob("from_step0_*/train_data_step1.jsonl"))) == 1
    # it finished (2 of 2 steps): another --resume does not wipe it
    with pytest.raises(UserError, match=r"logged 2 steps \(grpo.max_num_steps=2: it finished\)"):
        run_local(resolve_run(tiny_cfg(RECIPE, run, cache_dir, *off)), resume=True, progress=False)
    # it saved every step, but checkpointing.checkpoint_dir now points elsewhere: refused
    saved = tmp_path / "saved"
    run_local(resolve_run(tiny_cfg(RECIPE, saved, cache_dir, "grpo.max_num_steps=1")),
              progress=False)  # fmt: skip
    elsewhere = f"checkpointing.checkpoint_dir={tmp_path / 'elsewhere'}"
    with pytest.raises(UserError, match=r"logged 1 steps saving every 1 \(its checkpointing"):
        run_local(resolve_run(tiny_cfg(RECIPE, saved, cache_dir, elsewhere)), resume=True,
                  progress=False)  # fmt: skip
    # over the logs of two runs it cannot restart one: refused, nothing written
    other = tmp_path / "other" / "tensorboard"
    other.mkdir(parents=True)
    for f in (run / "tensorboard").glob("events.out.tfevents.*"):  # this run's id and another
        (other / f.name).write_bytes(f.read_bytes())
        (other / f"{f.name[: -len(first_id)]}0123456789ab").write_bytes(f.read_bytes())
    with pytest.raises(UserError, match=r"holds the logs of 2 runs"):
        run_local(
            resolve_run(tiny_cfg(RECIPE, other.parent, cache_dir, *off)),
            resume=True,
            progress=False,
        )


def test_resume_takes_the_configs_learning_rate_and_refuses_another_recipe(
    tmp_path, cache_dir, two_step_run
):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    msgs: list[str] = []
    res = run_local(
        resolve_run(
            tiny_cfg(
                RECIPE, run, cache_dir, "grpo.max_num_steps=3", "policy.optimizer.kwargs.lr=1e-7"
            )
        ),
        resume=True,
        progress=False,
        log=msgs.append,
    )
    assert res.first_step == 2 and res.history[0]["train/lr"] == 1e-7
    assert "policy.optimizer.kwargs.lr" in "\n".join(msgs)
    # FP32 scales on a pow2 run's checkpoint: refused before any work (no warm start)
    fp32 = "policy.megatron_cfg.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES='1'"
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match=r"differs in .*pow2"):
        run_local(
            resolve_run(tiny_cfg(RECIPE, run, cache, "grpo.max_num_steps=4", fp32)),
            resume=True,
            progress=False,
        )
    assert not cache.exists()


def test_a_refused_validation_refit_counts_once_across_a_resume(tmp_path, cache_dir):
    """The refit a validation makes (after step 1, for step 2) is refused: the step that uses
    it counts the refusal, so a checkpoint taken between them holds the total a resumed run
    reaches (found by the diff review: the resumed run counted it twice)."""

    def bad(step, weights):  # the refit for step 2 carries a NaN
        if step == 2:
            weights = dict(weights)
            k = next(iter(weights))
            weights[k] = torch.full_like(weights[k], float("nan"))
        return weights

    every = ("grpo.val_period=1", "checkpointing.save_period=1")
    hooks = Hooks(before_refit=bad)
    full = run_local(resolve_run(tiny_cfg(RECIPE, tmp_path / "full", cache_dir, *every)),
                     progress=False, log=lambda _m: None, hooks=hooks)  # fmt: skip
    part = tmp_path / "part"
    run_local(resolve_run(tiny_cfg(RECIPE, part, cache_dir, *every, "grpo.max_num_steps=1")),
              progress=False, log=lambda _m: None, hooks=hooks)  # fmt: skip
    res = run_local(resolve_run(tiny_cfg(RECIPE, part, cache_dir, *every)), resume=True,
                    progress=False, log=lambda _m: None, hooks=hooks)  # fmt: skip
    key = "jetrl/local/refit_refused_total"
    assert full.history[1]["jetrl/local/refit_refused"] == 1.0
    assert [h[key] for h in full.history] == [0.0, 1.0]
    assert res.history[0][key] == full.history[1][key]
