"""A local ``--resume`` is compared with what identifies the run that wrote the checkpoint (model
config, tokenizer, seed, dtype, task, warm start: `run_identity`), before any work. Found by a
review running the real ``jetrl train --backend local --resume``: a model config of the same
shapes (rope_theta x10) or another ``grpo.seed`` resumed with exit 0 and no word (the weights
ran under another architecture; the validation set and warm start were the new seed's), another
shape failed with a traceback after a new warm start; an incomplete ``step_N`` was skipped
without a word, and with every one incomplete the error said there was no checkpoint at all.
An unchanged config resumes exactly: tests/runs/test_faults_run_dirs.py
(test_kill_during_save_then_resume_matches_uninterrupted_run)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from local_configs import EXAMPLES, REPO, TINY_OVERRIDES, tiny_cfg

from nemo_jetrl.backends.local import checkpoint as ckpt
from nemo_jetrl.backends.local.config import LocalSettings, RunSettings
from nemo_jetrl.backends.local.loop import resolve_run, run_local
from nemo_jetrl.backends.local.run_identity import IDENTITY_KEY, identity_issues, run_identity
from nemo_jetrl.cli import main

RECIPE = "jetrl"
ASSET = REPO / "nemo_jetrl" / "backends" / "local" / "assets" / "model_config.json"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, cache_dir) -> Path:
    """A finished 2-step run (checkpoints step_1, step_2), its warm start in ``cache_dir``."""
    d = tmp_path_factory.mktemp("two") / "run"
    run_local(resolve_run(tiny_cfg(RECIPE, d, cache_dir)), progress=False, log=lambda _m: None)
    return d


@pytest.fixture
def run_copy(tmp_path, saved_run) -> Path:
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    return run


def _tree(d: Path) -> dict[str, tuple[int, int] | None]:
    """Every file (size, mtime) and directory under ``d``: what a run would have written."""
    return {
        str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
        for p in sorted(d.rglob("*"))
    }


def _train(run: Path, cache: Path, *extra: str, resume: bool = True) -> int:
    argv = ["train", str(EXAMPLES / f"{RECIPE}.yaml"), *TINY_OVERRIDES]
    argv += [f"jetrl.local.cache_dir={cache}", f"logger.log_dir={run}", *extra]
    return main([*argv, "--backend", "local", "--no-progress", *(["--resume"] * resume)])


def _same_shapes_model(path: Path) -> Path:
    """The repo's Llama with rope_theta x10 and another rms_norm_eps: the checkpoint's weights
    load into it (same shapes) and compute something else."""
    cfg = json.loads(ASSET.read_text())
    cfg.update(rope_theta=cfg.get("rope_theta", 10000.0) * 10, rms_norm_eps=1e-3)
    path.write_text(json.dumps(cfg))
    return path


# ------------------------------------------------------------ refused before any work (exit 2)


@pytest.mark.parametrize(
    ("change", "key", "said"),
    [
        ("model", "jetrl.local.model_config",
         ("rope_parameters.rope_theta 10000.0 -> 100000.0", "rms_norm_eps 1e-06 -> 0.001")),
        ("moe", "jetrl.local.model_config", ("model_type 'llama' -> 'qwen3_moe'",)),
        ("grpo.seed=7", "grpo.seed", ("42 in checkpoint", "7 in this config")),
        ("jetrl.local.dtype=float32", "jetrl.local.dtype", ("'bfloat16' in checkpoint",)),
        ("jetrl.local.batch_invariant=false", "jetrl.local.batch_invariant", ("True in",)),
        ("jetrl.local.task.val_size=8", "jetrl.local.task.val_size", ("4 in checkpoint",)),
        ("jetrl.local.warmstart.steps=5", "jetrl.local.warmstart.steps", ("3 in checkpoint",)),
        ("jetrl.local.warmstart.enabled=false", "jetrl.local.warmstart", ("no warm start",)),
    ],
)  # fmt: skip
def test_a_changed_identity_is_refused_before_any_work(
    change, key, said, tmp_path, run_copy, cache_dir, capsys
):
    if change == "model":
        change = f"jetrl.local.model_config={_same_shapes_model(tmp_path / 'rope.json')}"
    elif change == "moe":  # other shapes: was a KeyError traceback after a new warm start
        change = f"jetrl.local.model_config={EXAMPLES / 'moe' / 'qwen3_moe_tiny.json'}"
    run_before, cache_before = _tree(run_copy), _tree(cache_dir)
    rc = _train(run_copy, cache_dir, change, "grpo.max_num_steps=3")
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    step_2 = run_copy / "checkpoints" / "step_2"
    assert f"  - {key}: " in err and f"checkpoint {step_2}" in err, err
    assert all(s in err for s in said), err
    assert "Resume with the config that wrote the checkpoint" in err, err
    # before any work: no warm start trained for the new config, nothing written in the run
    assert _tree(cache_dir) == cache_before
    assert _tree(run_copy) == run_before


def test_every_changed_key_is_named_once(run_copy, cache_dir, capsys):
    rc = _train(run_copy, cache_dir, "grpo.seed=7", "jetrl.local.task.ops=+-*")
    err = capsys.readouterr().err
    assert rc == 2 and "2 problems in config" in err, err
    assert err.count("  - grpo.seed: ") == 1 and err.count("  - jetrl.local.task.ops: ") == 1


def test_hyperparameters_may_change_and_a_checkpoint_records_its_run(run_copy, cache_dir):
    """What may change on a resubmission is not compared (the learning rate, the group size,
    the temperature, the KL penalty); the resumed run's checkpoint records the same run."""
    extra = ("grpo.max_num_steps=3", "grpo.num_generations_per_prompt=4")
    extra += ("policy.generation.temperature=0.7", "loss_fn.reference_policy_kl_penalty=0.01")
    msgs: list[str] = []
    res = run_local(resolve_run(tiny_cfg(RECIPE, run_copy, cache_dir, *extra)), resume=True,
                    progress=False, log=msgs.append)  # fmt: skip
    assert res.first_step == 2 and res.last_step == 3
    assert not any("not compared" in m for m in msgs), msgs
    state = ckpt.load_checkpoint(run_copy / "checkpoints" / "step_3")[1]
    resolved = resolve_run(tiny_cfg(RECIPE, run_copy, cache_dir, *extra))
    assert state[IDENTITY_KEY] == run_identity(resolved.run, resolved.local)


# --------------------------------------------------- a checkpoint written before the record


def _drop_identity(step_dir: Path) -> None:
    """Rewrite ``step_dir``'s state.pt as a checkpoint from before the record, manifest kept
    true (a manifest-checked file without the record, as such a checkpoint is)."""
    state_file = step_dir / ckpt.STATE_FILE
    state = torch.load(state_file, weights_only=True)
    del state[IDENTITY_KEY]
    torch.save(state, state_file)
    manifest = json.loads((step_dir / ckpt.MANIFEST_FILE).read_text())
    blob = state_file.read_bytes()
    manifest["files"][ckpt.STATE_FILE] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}  # fmt: skip
    (step_dir / ckpt.MANIFEST_FILE).write_text(json.dumps(manifest))


def test_a_checkpoint_without_the_record_resumes_with_a_note(run_copy, cache_dir):
    _drop_identity(run_copy / "checkpoints" / "step_2")
    msgs: list[str] = []
    res = run_local(resolve_run(tiny_cfg(RECIPE, run_copy, cache_dir, "grpo.max_num_steps=3")),
                    resume=True, progress=False, log=msgs.append)  # fmt: skip
    assert res.first_step == 2 and res.last_step == 3
    [note] = [m for m in msgs if "not compared" in m]
    assert note.startswith("--resume: checkpoint ") and "step_2 was written before" in note
    assert "grpo.seed" in note and "jetrl.local.model_config" in note and "\n" not in note
    state = ckpt.load_checkpoint(run_copy / "checkpoints" / "step_3")[1]
    assert state[IDENTITY_KEY]["grpo.seed"] == 42  # its next checkpoint records it


# --------------------------------------------------------------------- incomplete checkpoints


def test_an_incomplete_checkpoint_is_named_and_skipped(run_copy, cache_dir):
    ck = run_copy / "checkpoints"
    (ck / "step_2" / ckpt.STATE_FILE).unlink()
    msgs: list[str] = []
    res = run_local(resolve_run(tiny_cfg(RECIPE, run_copy, cache_dir)), resume=True,
                    progress=False, log=msgs.append)  # fmt: skip
    text = "\n".join(msgs)
    assert f"--resume: skipping {ck / 'step_2'}: state.pt missing" in text, text
    assert f"resumed from {ck / 'step_1'}" in text
    assert res.first_step == 1 and ckpt.verify_checkpoint(ck / "step_2") == []  # redone


def test_all_incomplete_checkpoints_are_called_damaged_not_absent(run_copy, cache_dir, capsys):
    ck = run_copy / "checkpoints"
    (ck / "step_2" / ckpt.STATE_FILE).unlink()
    (ck / "step_1" / ckpt.MODEL_FILE).unlink()
    before = _tree(run_copy)
    assert _train(run_copy, cache_dir) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Point checkpointing.checkpoint_dir at its" not in err, err
    assert f"no usable checkpoint in {ck}: all 2 checkpoints are damaged" in err, err
    assert "step_2: state.pt missing" in err and "step_1: model.safetensors missing" in err
    # and a fresh run saving into them is refused as over any earlier run's checkpoints
    fresh = run_copy.parent / "fresh"
    assert _train(fresh, cache_dir, f"checkpointing.checkpoint_dir={ck}", resume=False) == 2
    err = capsys.readouterr().err
    assert f"{ck} already holds checkpoints of an earlier run (step_1, step_2)" in err, err
    assert _tree(run_copy) == before


# ------------------------------------------------------------------------- the rules, unit


def _identity(**local) -> dict:
    return run_identity(RunSettings(), LocalSettings(**local))


def test_what_a_model_config_comparison_ignores_and_what_it_does_not(tmp_path) -> None:
    path = Path("/runs/x/checkpoints/step_4")
    base = _identity()
    other = json.loads(json.dumps(base))
    other["jetrl.local.model_config"]["transformers_version"] = "0.0.1"  # another library
    other["jetrl.local.model_config"]["_name_or_path"] = "/elsewhere"
    assert identity_issues({IDENTITY_KEY: other}, base, path) == ([], [])
    cfg = json.loads(ASSET.read_text())
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}  # a field the record lacks
    (tmp_path / "scaled.json").write_text(json.dumps(cfg))
    scaled = _identity(model_config=str(tmp_path / "scaled.json"))
    issues, _ = identity_issues({IDENTITY_KEY: base}, scaled, path)
    assert [i.path for i in issues] == ["jetrl.local.model_config"], issues
    assert "rope_parameters.factor <absent> -> 2.0" in issues[0].message, issues[0].message


def test_noted_keys_resume_and_a_warm_start_that_makes_no_weights_may_change() -> None:
    path = Path("/runs/x/checkpoints/step_4")
    was = _identity()
    now = {**was, "jetrl.local.rollout_engine": "vllm", "jetrl.local.device": "cuda"}
    issues, notes = identity_issues({IDENTITY_KEY: was}, now, path)
    assert issues == [] and len(notes) == 2
    assert notes[0].startswith("jetrl.local.rollout_engine 'hf' in checkpoint /runs/x/")
    assert "'vllm' in this config: the config's applies" in notes[0]
    from nemo_jetrl.backends.local.config import WarmStartSettings as W

    off = {IDENTITY_KEY: _identity(warmstart=W(enabled=False, steps=9))}
    assert identity_issues(off, _identity(warmstart=W(steps=0, lr=0.5)), path) == ([], [])
    issues, _ = identity_issues(off, _identity(), path)
    assert [i.path for i in issues] == ["jetrl.local.warmstart"]
    assert "no warm start (enabled: false or steps: 0) in checkpoint" in issues[0].message
    assert "a warm start of 150 steps in this config" in issues[0].message
