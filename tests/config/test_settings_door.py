"""Issue 38: the raw config is read at the door, and below it modules take typed settings.

A ratchet: the modules outside `nemo_jetrl/config/` and the NeMo-RL boundary
(`nemo_jetrl/backends/nemo_rl/`) that still touch OmegaConf may only get fewer (lower
`MAX_RAW_READERS` as they go; the issue's target is 3: `runs/logs.py` reading a logged
config.yaml as data, `commands/align.py` editing the file, the local backend's door
`backends/local/setup.resolve_run`). No function below the door takes the whole tree as a
parameter (the local run takes `setup.ResolvedRun`). And the typed `Settings` hold each key's
default once.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_jetrl.config import load_valid_config, settings_of

PKG = Path(__file__).resolve().parents[2] / "nemo_jetrl"
RAW = re.compile(r"omegaconf|DictConfig|OmegaConf")
DOORS = ("config/", "backends/nemo_rl/")
MAX_RAW_READERS = 3  # 19 before issue 38; 6 after its first stage


def _raw_readers() -> list[str]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if not rel.startswith(DOORS) and RAW.search(path.read_text(encoding="utf-8")):
            out.append(rel)
    return out


def test_raw_config_readers_only_get_fewer():
    found = _raw_readers()
    assert len(found) <= MAX_RAW_READERS, (
        f"{len(found)} modules below the door read the raw OmegaConf tree (at most "
        f"{MAX_RAW_READERS}): {found}; take `nemo_jetrl.config.Settings` (or a typed section) "
        "instead"
    )


#: Functions below the door that may take a parameter named ``cfg`` typed Any/DictConfig (or not
#: typed), and why: each hands the tree to `nemo_jetrl.config` untouched or is not our config.
TREE_TAKERS = {
    ("backends/local/setup.py", "resolve_run"): "the local backend's door",
    ("backends/local/setup.py", "_loss_config"): "resolve_run's reader of loss_fn",
    ("backends/local/setup.py", "_run_settings"): "resolve_run's reader of the run keys",
    ("flow/pipeline.py", "check_config"): "a YAML path or tree, passed to config.load_valid_config",
    ("megatron/export.py", "from_megatron_config"): "Megatron-Core's TransformerConfig",
    ("invariant/hf.py", "_replacement"): "an Fp8LinearConfig or None",
}


def _tree_takers() -> set[tuple[str, str]]:
    out = set()
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith(DOORS):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            for a in args:
                ann = ast.unparse(a.annotation) if a.annotation is not None else "Any"
                # (a section parser's `Mapping[str, Any]`, e.g. rl.correction's of loss_fn, is fine)
                if a.arg == "cfg" and (ann.endswith("Any") or "DictConfig" in ann):
                    out.add((rel, node.name))
    return out


def test_no_function_below_the_door_takes_the_whole_tree():
    """Before issue 38's last stage `run_local(cfg)` and `LocalRun(cfg)` took the tree (and
    `LocalRun` read MoE settings from it again); they take `ResolvedRun` now."""
    found = _tree_takers()
    assert found <= set(TREE_TAKERS), (
        f"{sorted(found - set(TREE_TAKERS))} take the raw config below the door: take "
        "`nemo_jetrl.config.Settings` or the typed section (e.g. backends.local.setup.ResolvedRun)"
    )
    assert ("backends/local/setup.py", "resolve_run") in found  # the scan sees a real taker


def test_each_default_is_read_once_into_the_settings():
    s = settings_of({"policy": {"model_name": "Qwen/Qwen3-8B-Base"}})
    assert s.lag.max_age == 1 and not s.lag.async_enabled  # NeMo-RL's default age
    assert s.refit.hook and s.refit.parity_check and s.refit.rollback and not s.refit.ours
    assert (s.moe.vllm_tp, s.moe.vllm_ep) == (1, 1) and s.local.rollout_engine == "hf"
    assert s.model.chosen_by == "policy.model_name" and s.megatron_enabled is None
    given = settings_of(
        OmegaConf.create(
            {
                "grpo": {"async_grpo": {"enabled": True, "max_trajectory_age_steps": 3}},
                "policy": {
                    "quant_cfg": {"algo": "${oc.env:Q}"},  # as written: a message never resolves it
                    "generation": {"vllm_cfg": {"tensor_parallel_size": 4}},
                },
                "jetrl": {"vllm_patch": True, "model_config": "/m.json"},
            }
        )
    )
    assert given.lag.max_age == 3 and given.lag.async_enabled and given.refit.ours
    assert given.moe.vllm_tp == 4 and given.model.chosen_by == "jetrl.model_config"
    assert dict(given.quant_cfg)["policy.quant_cfg"] == {"algo": "${oc.env:Q}"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        given.lag.max_age = 0  # type: ignore[misc]


def test_the_door_builds_the_settings_once_with_the_recipe():
    repo = PKG.parent
    valid = load_valid_config(repo / "examples/configs/qwen3_8b_base/jetrl.yaml")
    assert valid.settings == settings_of(valid.cfg)
    assert valid.settings.model.name == OmegaConf.select(valid.cfg, "policy.model_name")


def test_jetrl_train_validates_the_config_once(tmp_path, monkeypatch, capsys):
    """`jetrl train --backend local` parses at the door: the run reuses what the check read
    (before issue 38's stage 3 the tree was validated 3 times: check, resolve, run)."""
    import sys

    import nemo_jetrl.config as config_pkg
    from nemo_jetrl.cli import main

    validate_mod = sys.modules[
        "nemo_jetrl.config.validate"
    ]  # the package's `validate` is a function

    calls = []
    real = validate_mod.validated

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(validate_mod, "validated", counted)  # recipe_from_config's
    monkeypatch.setattr(config_pkg, "validated", counted)  # load_valid_config's
    local = PKG.parent / "examples" / "configs" / "local"
    args = [
        "train",
        str(local / "bf16.yaml"),
        "grpo.max_num_steps=1",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=2",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "jetrl.local.task.num_ops=1",
        "jetrl.local.warmstart.steps=3",
        "jetrl.local.warmstart.batch_size=8",
        f"jetrl.local.cache_dir={tmp_path / 'cache'}",
        f"logger.log_dir={tmp_path / 'run'}",
        "--backend",
        "local",
        "--no-progress",
    ]
    assert main(args) == 0, capsys.readouterr().err
    assert len(calls) == 1


def test_the_local_run_given_the_raw_tree_says_to_resolve_it_first():
    """`run_local(cfg)` / `LocalRun(cfg)` (how they were called before the typed door) fail at
    once with the call to make, before any directory is locked or model built."""
    from nemo_jetrl.backends.local.loop import LocalRun, run_local

    cfg = OmegaConf.create({"policy": {"model_name": "Qwen/Qwen3-8B-Base"}})
    with pytest.raises(TypeError, match=r"run_local\(resolve_run\(cfg\)\)"):
        run_local(cfg, progress=False)
    with pytest.raises(TypeError, match=r"LocalRun\(resolve_run\(cfg\)\)"):
        LocalRun(cfg)
