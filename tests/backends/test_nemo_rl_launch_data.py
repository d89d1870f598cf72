"""NeMo-RL tier (issue 36): ``jetrl train --backend nemo-rl`` from a directory outside both
checkouts reaches NeMo-RL's ``grpo.setup`` with its real config loading and its real data setup.

The launch runs unchanged: our config on NeMo-RL's ``grpo_math_1B_megatron.yaml`` (whose
``data.default.prompt_file`` is ``examples/prompts/cot.txt``, relative to NeMo-RL's tree),
``MasterConfig``, ``get_tokenizer``, ``configure_generation_config`` and ``setup_response_data``
(``load_response_dataset``, ``TaskDataSpec`` reading the shipped prompt file,
``AllTaskProcessedDataset`` with ``math_hf_data_processor``). Stand-ins, for what needs a Ray
cluster or GPUs only: ``init_ray`` (records that it ran), ``create_env`` (the math environment is
a Ray actor) and ``grpo.setup`` / the trainers (GPU workers). The dataset is a local JSONL file
read by NeMo-RL's ``ResponseDataset`` (OpenMathInstruct-2, the default, comes from the hub).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
from nemo_rl_upstream import tree_dir

REPO = Path(__file__).resolve().parents[2]
CONFIGS = [
    REPO / "examples" / "configs" / "qwen3_8b_base" / "jetrl.yaml",
    REPO / "examples" / "configs" / "smoke" / "qwen3_1.7b_jetrl.yaml",
]
ROWS = 40

pytestmark = pytest.mark.nemo_rl


class _Reached(Exception):
    pass


def _workdir(tmp_path: Path) -> Path:
    """A launch directory outside both checkouts: a local dataset and a tokenizer, nothing else."""
    from hf_models import char_tokenizer

    work = tmp_path / "work"
    work.mkdir()
    with open(work / "train.jsonl", "w") as f:
        for i in range(ROWS):
            f.write(json.dumps({"problem": f"What is {i} + {i}?", "expected_answer": str(2 * i)}))
            f.write("\n")
    tok = char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(work / "tok")
    return work


def _overrides(extra: tuple[str, ...] = (), config: Path = CONFIGS[0]) -> list[str]:
    # The smoke config names NeMo-RL's GSM8K (hub) for train and validation: local file instead.
    smoke = "smoke" in config.parts
    return [
        ("" if smoke else "+") + "data.train.dataset_name=ResponseDataset",
        *(["data.validation=null"] if smoke else []),
        "+data.train.data_path=train.jsonl",  # relative to the launch directory
        "+data.train.input_key=problem",
        "+data.train.output_key=expected_answer",
        "policy.tokenizer.name=tok",
        "logger.tensorboard_enabled=false",
        "logger.monitor_gpus=false",
        *extra,
    ]


def _stand_ins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trainer: bool) -> dict[str, Any]:
    from nemo_rl.algorithms import grpo
    from nemo_rl.data import utils as data_utils
    from nemo_rl.distributed import virtual_cluster

    seen: dict[str, Any] = {"order": []}
    monkeypatch.setenv("NEMO_RL_DIR", str(tree_dir()))
    monkeypatch.setenv("NEMO_RL_VENV_DIR", str(tmp_path / "venvs"))  # nothing built here
    monkeypatch.delenv("NRL_FORCE_REBUILD_VENVS", raising=False)
    monkeypatch.setattr(virtual_cluster, "init_ray", lambda *a, **k: seen["order"].append("ray"))

    def create_env(env_name: str, env_config: Any) -> str:  # stand-in: a Ray actor
        seen["order"].append(f"env:{env_name}")
        return f"<{env_name} env>"

    monkeypatch.setattr(data_utils, "create_env", create_env)

    class Generation:
        def shutdown(self) -> None:
            seen["order"].append("shutdown")

    def setup(config, tokenizer, dataset, val_dataset, policy_factory=None):
        from nemo_rl.distributed import ray_actor_environment_registry as reg

        from nemo_jetrl.backends.nemo_rl.translate import POLICY_WORKER_FQN

        seen.update(config=config, tokenizer=tokenizer, dataset=dataset, val=val_dataset)
        seen["registry_entry"] = reg.ACTOR_ENVIRONMENT_REGISTRY.get(POLICY_WORKER_FQN)
        seen["order"].append("setup")
        if not trainer:
            raise _Reached()
        loss = type("Loss", (), {"input_type": "LOGPROB"})()
        return (None, Generation(), None, None, "dl", "vdl", loss, object(), "ckpt", {}, config,
                "teachers", "aliases")  # fmt: skip

    # NeMo-RL's REAL trainers, stopped at their first Timer(): the driver's call binds to their
    # signatures and their start asserts run (async: an async engine, IS correction), where
    # stand-ins taking *args / **kwargs let any call through (issue 46's audit).
    class _TrainStarted(Exception):
        pass

    def stop(*a: Any, **k: Any) -> None:
        raise _TrainStarted()

    monkeypatch.setattr(grpo, "Timer", stop)
    real_sync, real_async = grpo.grpo_train, grpo.async_grpo_train

    def sync_train(*args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(real_sync).bind(*args, **kwargs)
        seen["order"].append("grpo_train")
        seen["loss_fn"] = bound.arguments["loss_fn"]
        with pytest.raises(_TrainStarted):
            real_sync(*args, **kwargs)

    def async_train(*args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(real_async).bind(*args, **kwargs)
        seen["order"].append("async_grpo_train")
        seen["async_kwargs"] = bound.arguments
        with pytest.raises(_TrainStarted):
            real_async(*args, **kwargs)

    monkeypatch.setattr(grpo, "setup", setup)
    monkeypatch.setattr(grpo, "grpo_train", sync_train)
    monkeypatch.setattr(grpo, "async_grpo_train", async_train)
    return seen


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.parent.name)
def test_launch_reaches_grpo_setup_with_real_data_from_any_directory(config, tmp_path, monkeypatch):
    from nemo_jetrl.backends.nemo_rl import launch as nr
    from nemo_jetrl.backends.nemo_rl.translate import POLICY_WORKER_FQN, STOCK_POLICY_WORKER

    work = _workdir(tmp_path)
    monkeypatch.chdir(work)
    seen = _stand_ins(monkeypatch, tmp_path, trainer=False)
    with pytest.raises(_Reached):
        nr.run_nemo_rl(str(config), _overrides(config=config))
    assert seen["order"] == ["ray", "env:math", "setup"]  # Ray before data, as run_grpo.py
    cfg = seen["config"]
    prompt = tree_dir() / "examples" / "prompts" / "cot.txt"
    assert cfg.data["default"]["prompt_file"] == str(prompt)
    assert cfg.data["train"][0]["data_path"] == str(work / "train.jsonl")
    assert Path(cfg.logger["log_dir"]).parent.parent == work / "logs"
    assert Path(cfg.logger["log_dir"]).name == "exp_001"
    assert Path(cfg.checkpointing["checkpoint_dir"]).is_absolute()
    assert str(cfg.checkpointing["checkpoint_dir"]).startswith(str(work / "results"))
    # NeMo-RL's own data setup ran on the file: 5% split off for validation (its default).
    assert len(seen["dataset"]) + len(seen["val"]) == ROWS and len(seen["val"]) == 2
    item = seen["dataset"][0]
    text = seen["tokenizer"].decode(item["message_log"][0]["token_ids"])
    # cot.txt, formatted with the problem (the char tokenizer reads its newlines as <unk>).
    assert text.startswith("Think step-by-step to solve the following problem.")
    assert "\\\\boxed{} tags." in text and "What is" in text
    assert "Let's think step-by-step" in text
    assert item["extra_env_info"]["ground_truth"].isdigit()
    # Our worker ran on the stock Megatron entry (no venv built here), and was unregistered after.
    from nemo_rl.distributed import ray_actor_environment_registry as reg

    assert seen["registry_entry"] == reg.ACTOR_ENVIRONMENT_REGISTRY[STOCK_POLICY_WORKER]
    assert POLICY_WORKER_FQN not in reg.ACTOR_ENVIRONMENT_REGISTRY
    # Nothing built here: NeMo-RL would build the venvs without nemo_jetrl, so the overlay (with
    # our vLLM plugin's entry points) leads the workers' PYTHONPATH.
    overlay = Path(cfg.logger["log_dir"]) / "nemo_jetrl_overlay"
    for env in (
        cfg.policy["megatron_cfg"]["env_vars"],
        cfg.policy["generation"]["vllm_cfg"]["env_vars"],
    ):
        assert env["PYTHONPATH"].split(":")[0] == str(overlay)
    assert any(p.name.endswith(".dist-info") for p in overlay.iterdir())


def test_missing_path_exits_2_naming_the_key_before_ray(tmp_path, monkeypatch, capsys):
    from nemo_jetrl.cli import main

    work = _workdir(tmp_path)
    monkeypatch.chdir(work)
    seen = _stand_ins(monkeypatch, tmp_path, trainer=False)
    argv = ["train", str(CONFIGS[0]), "--backend", "nemo-rl", *_overrides()]
    rc = main([*argv, "+data.default.prompt_file=prompts/missing.txt"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "data.default.prompt_file: 'prompts/missing.txt' does not exist" in err
    assert seen["order"] == []  # no Ray, no environment, no setup


# docs/cluster.md's async keys: NeMo-RL's async_grpo_train asserts the next four at its start.
ASYNC_KEYS = (
    "cluster.num_nodes=2",  # the recipe's TP x PP x CP = 8 on one node, vLLM on the other
    "+grpo.async_grpo.enabled=true",
    "policy.generation.vllm_cfg.async_engine=true",
    "policy.generation.colocated.enabled=false",
    "policy.generation.colocated.resources.num_nodes=1",
    "policy.generation.colocated.resources.gpus_per_node=8",
    "loss_fn.use_importance_sampling_correction=true",
    "jetrl.allow_off_policy=true",  # off-policy by policy lag, whatever the precision
)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [((), "grpo_train"), (ASYNC_KEYS, "async_grpo_train")],
    ids=["sync", "async"],
)
def test_trainer_follows_run_grpo(extra, expected, tmp_path, monkeypatch):
    from nemo_jetrl.backends.nemo_rl import launch as nr
    from nemo_jetrl.backends.nemo_rl.metrics import MismatchMetricsLoss

    work = _workdir(tmp_path)
    monkeypatch.chdir(work)
    seen = _stand_ins(monkeypatch, tmp_path, trainer=True)
    # bf16: the dispatch does not depend on the recipe, and no FP8 engine needs proving (the
    # generation stand-in has no vLLM engine to ask).
    bf16 = CONFIGS[0].with_name("bf16.yaml")
    assert nr.run_nemo_rl(str(bf16), _overrides(extra)) == 0
    assert seen["order"][-2:] == [expected, "shutdown"]
    if expected == "async_grpo_train":
        kw = seen["async_kwargs"]
        assert isinstance(kw["loss_fn"], MismatchMetricsLoss)
        assert kw["max_trajectory_age_steps"] == 1  # NeMo-RL's default, from its config
        assert kw["teacher_worker_groups"] == "teachers"
    else:
        assert isinstance(seen["loss_fn"], MismatchMetricsLoss)


def test_data_plane_is_refused_by_name_before_ray(tmp_path, monkeypatch):
    from nemo_jetrl.backends.nemo_rl import launch as nr
    from nemo_jetrl.errors import UserError

    work = _workdir(tmp_path)
    monkeypatch.chdir(work)
    seen = _stand_ins(monkeypatch, tmp_path, trainer=True)
    with pytest.raises(UserError, match=r"data_plane\.enabled=true"):
        nr.run_nemo_rl(str(CONFIGS[0]), _overrides(("+data_plane.enabled=true",)))
    assert seen["order"] == []


def test_async_without_the_async_engine_is_refused_before_ray(tmp_path, monkeypatch):
    from nemo_jetrl.backends.nemo_rl import launch as nr
    from nemo_jetrl.errors import UserError

    work = _workdir(tmp_path)
    monkeypatch.chdir(work)
    seen = _stand_ins(monkeypatch, tmp_path, trainer=True)
    bf16 = CONFIGS[0].with_name("bf16.yaml")
    with pytest.raises(UserError, match=r"policy\.generation\.vllm_cfg\.async_engine=true"):
        nr.run_nemo_rl(str(bf16), _overrides(("+grpo.async_grpo.enabled=true", ASYNC_KEYS[-1])))
    assert seen["order"] == []  # no Ray, no environment, no setup
    with pytest.raises(UserError, match=r"off-policy by policy lag.*jetrl\.allow_off_policy=true"):
        nr.run_nemo_rl(str(bf16), _overrides(ASYNC_KEYS[:-1]))  # refused as jetrl check says
    assert seen["order"] == []


def test_venv_dir_default_and_vllm_pin_are_nemo_rl_s(monkeypatch):
    """Bare metal: our default is NeMo-RL's own DEFAULT_VENV_DIR (<git root>/venvs); the vLLM
    pin read from the tree's pyproject is the vLLM this tree ships (scripts/nemo_rl_env.sh)."""
    import os

    from nemo_rl.utils import venvs as nrl_venvs

    from nemo_jetrl.backends.nemo_rl import venvs
    from nemo_jetrl.backends.nemo_rl.launch import nemo_rl_pinned_vllm

    monkeypatch.delenv("NEMO_RL_VENV_DIR", raising=False)
    # the same directory (a symlinked checkout spells it two ways: ours is resolved)
    assert venvs.venv_dir().resolve() == Path(nrl_venvs.DEFAULT_VENV_DIR).resolve()
    assert nemo_rl_pinned_vllm(tree_dir()) == os.environ["NEMO_RL_VLLM_VERSION"]


def test_smoke_config_passes_nemo_rl_loader_and_grpo_setup(tmp_path, monkeypatch):
    """The one-node smoke config: NeMo-RL's own loader reads it as ours does, and NeMo-RL's
    grpo.setup (up to the vLLM workers) and its packing rules accept what our launch hands it."""
    from nemo_rl_upstream import (
        check_sequence_padding,
        drive_setup,
        nemo_rl_load,
        with_nemo_rl_defaults,
    )
    from omegaconf import OmegaConf

    from nemo_jetrl.backends.nemo_rl import launch as nr
    from nemo_jetrl.config import load_config

    smoke = CONFIGS[1]
    assert nemo_rl_load(smoke) == OmegaConf.to_container(load_config(smoke), resolve=True)
    master = drive_setup(
        with_nemo_rl_defaults(nr.prepare(str(smoke)).plan.master_config), tmp_path, monkeypatch
    )
    check_sequence_padding(master)
    assert master.cluster["num_nodes"] == 1 and master.cluster["gpus_per_node"] == 8
