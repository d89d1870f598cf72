"""NeMo-RL's split of the cluster's GPUs between training and vLLM (`resources.py`), checked
before the job allocates its nodes: NeMo-RL asserts it in ``grpo.setup`` / ``lm_policy.py`` /
``vllm_generation.py`` after Ray started. Every GRPO config NeMo-RL ships (both trees, colocated
and not, 1 to 64 nodes) passes the rule: it refuses nothing NeMo-RL runs."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import NEMO_RL_UPSTREAM
from omegaconf import OmegaConf

from nemo_jetrl.backends.nemo_rl import driver
from nemo_jetrl.backends.nemo_rl.resources import gpu_split, resource_problems
from nemo_jetrl.config import load_config
from nemo_jetrl.errors import UserError

QWEN8 = "examples/configs/qwen3_8b_base/jetrl.yaml"  # Megatron TP 2 x PP 2 x CP 2, 1 node x 8
RES = "policy.generation.colocated.resources"
APART = ["policy.generation.colocated.enabled=false"]


def _cfg(path: str, *overrides: str) -> dict:
    return OmegaConf.to_container(load_config(path, list(overrides)), resolve=True)


def test_the_docs_async_example_gave_training_4_gpus_for_a_model_parallel_size_of_8():
    """docs/cluster.md's first async example: generation took 4 of the node's 8 GPUs, training
    the other 4, and the recipe's TP x PP x CP is 8 (NeMo-RL: "World size (4) is insufficient")."""
    [(key, why)] = resource_problems(_cfg(QWEN8, *APART, f"{RES}.gpus_per_node=4"))
    assert key == "policy.megatron_cfg.tensor_model_parallel_size"
    assert why.startswith("2: NeMo-RL gives training 4 (cluster.gpus_per_node=8 - 4 for vLLM)")
    assert "tensor=2 x pipeline=2 x context=2 = 8" in why
    # what the docs run now: generation on a node of its own, training on the other
    two = ["cluster.num_nodes=2", f"{RES}.num_nodes=1", f"{RES}.gpus_per_node=8"]
    assert resource_problems(_cfg(QWEN8, *APART, *two)) == []
    assert gpu_split(_cfg(QWEN8, *APART, *two), []).train == 8
    assert resource_problems(_cfg(QWEN8)) == []  # colocated: all 8


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        ([f"{RES}.gpus_per_node=8"], f"{RES}.gpus_per_node", "set it between 1 and 7"),
        ([f"{RES}.gpus_per_node=null"], f"{RES}.gpus_per_node", "None: with vLLM on its own"),
        (["cluster.num_nodes=2", f"{RES}.num_nodes=2", f"{RES}.gpus_per_node=8"],
         f"{RES}.num_nodes", "set it between 1 and 1"),
        (["cluster.num_nodes=2", f"{RES}.num_nodes=1", f"{RES}.gpus_per_node=4"],
         f"{RES}.gpus_per_node", "set it to cluster.gpus_per_node (8)"),
    ],
)  # fmt: skip
def test_a_split_nemo_rl_asserts_against_names_the_key(overrides, key, says):
    problems = resource_problems(_cfg(QWEN8, *APART, *overrides))
    assert [k for k, _ in problems] == [key] and says in problems[0][1], problems


def test_vllms_model_parallel_size_must_divide_its_gpus():
    [(key, why)] = resource_problems(
        _cfg(QWEN8, "policy.generation.vllm_cfg.tensor_parallel_size=3")
    )
    assert key == "policy.generation.vllm_cfg.tensor_parallel_size"
    assert why.startswith("3: vLLM gets 8 GPUs, not a multiple of") and "3 x 1 = 3" in why


def test_the_launch_and_jetrl_check_refuse_it_with_the_trainers_problems():
    bad = [*APART, f"{RES}.gpus_per_node=4", "+data_plane.enabled=true"]
    with pytest.raises(UserError) as ei:
        driver.trainer_kind(_cfg(QWEN8, *bad))
    msg = str(ei.value)
    assert "policy.megatron_cfg.tensor_model_parallel_size=2: NeMo-RL gives training 4" in msg
    assert "data_plane.enabled=true" in msg  # reported together
    # a rehearsal rewrites the cluster to one CPU: the user's config is the one judged
    cpu = _cfg(QWEN8, "cluster.gpus_per_node=1")
    assert resource_problems(cpu)  # TP x PP x CP = 8 on 1 GPU
    assert driver.trainer_kind(cpu, gpus_of=_cfg(QWEN8)) == driver.SYNC


def test_a_reward_model_environment_is_left_to_nemo_rl():
    cfg = _cfg(QWEN8, *APART, f"{RES}.gpus_per_node=4")
    cfg["env"]["reward_model"] = {"enabled": True}
    assert resource_problems(cfg) == []


@pytest.mark.parametrize("tree", ["v0.7.0", "main-7ea279a"])
def test_no_config_nemo_rl_ships_is_refused(tree, monkeypatch):
    """Every YAML under NeMo-RL's examples/configs (GRPO, on-policy distillation with teachers
    on their own nodes, DTensor policies, SFT/DPO: review found the mopd-* recipes refused)."""
    monkeypatch.setenv("HF_HOME", "/hf")  # configs that read it (${oc.env:HF_HOME})
    root = NEMO_RL_UPSTREAM / tree / "examples/configs"
    kinds: Counter = Counter()
    for path in sorted(root.rglob("*.yaml")):
        cfg = _cfg(str(path))
        assert resource_problems(cfg) == [], path
        generation = (cfg.get("policy") or {}).get("generation") or {}
        colocated = (generation.get("colocated") or {}).get("enabled", True)
        kinds["colocated" if colocated else "apart"] += gpu_split(cfg, []) is not None
    assert kinds["colocated"] > 100 and kinds["apart"] > 20, kinds  # both splits were judged


def test_teachers_on_their_own_nodes_are_left_to_nemo_rl():
    """grpo.setup takes non-colocated OPD teachers' nodes off training's first (v0.7.0 :541,
    main :784): the split is not judged then, as with a reward model."""
    cfg = _cfg(QWEN8, *APART, f"{RES}.gpus_per_node=4")
    cfg["on_policy_distillation"] = {"non_colocated_teachers": {"enabled": True}}
    assert gpu_split(cfg, []) is None and resource_problems(cfg) == []
