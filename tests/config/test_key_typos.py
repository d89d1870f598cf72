"""A typo of a NeMo-RL key we read (`config.typed.near_misses`): NeMo-RL's other keys pass our
schema unchecked (we are never stricter than NeMo-RL on them), so ``grpo.max_num_step=2`` was
accepted and the run took grpo.max_num_steps' 16 steps (review, session 39). A key one typo from
one we read (two for names longer than 5 letters) is named: an error where the local backend
reads the keys itself (a ``jetrl.local`` section) and where a run starts (``train``,
``rehearse``), a warning for ``jetrl check`` of a cluster config; ``jetrl.not_typos`` lists keys
meant as written. No GRPO config of ours or of NeMo-RL's two trees holds such a key."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
from conftest import NEMO_RL_UPSTREAM, nemo_rl_upstream_trees

from nemo_jetrl.config.load import ConfigError, merged_container
from nemo_jetrl.config.nemo_rl_model import RunConfig
from nemo_jetrl.config.typed import near_misses, parse

REPO = Path(__file__).resolve().parents[2]


def _typos(data: dict) -> dict[str, tuple[str, str]]:
    assert not parse(RunConfig, data)[1]  # NeMo-RL's schema lets every one of them pass
    return {i.path: (i.level, i.message) for i in near_misses(RunConfig, data)}


def test_a_key_one_typo_from_one_we_read_is_named_with_the_key_meant():
    found = _typos(
        {
            "grpo": {"max_num_step": 2, "gpro_seed": 1, "val_num_generations_per_prompt": 4},
            "gpro": {"seed": 3},
            "dpo": {"x": 1},  # NeMo-RL's own section, two edits from grpo: not a typo of it
            "policy": {"generation": {"temprature": 0.5, "top_k": 3}},
        }
    )
    assert set(found) == {"grpo.max_num_step", "gpro", "policy.generation.temprature"}, found
    level, msg = found["grpo.max_num_step"]
    assert level == "warning" and msg.endswith("did you mean grpo.max_num_steps?"), msg
    assert "did you mean grpo?" in found["gpro"][1]
    assert "policy.generation.temperature" in found["policy.generation.temprature"][1]


def test_the_local_backend_refuses_it_and_a_cluster_config_warns(cli):
    local = REPO / "examples/configs/local/jetrl.yaml"
    code, out = cli("check", str(local), "++grpo.max_num_step=2")
    assert code == 2 and "grpo.max_num_step: unknown key, one typo from grpo.max_num_steps" in out
    cluster = REPO / "examples/configs/qwen3_8b_base/jetrl.yaml"
    code, out = cli("check", str(cluster), "++grpo.max_num_step=2")
    assert code == 0 and "warning: grpo.max_num_step: unknown key, one typo" in out, out
    code, out = cli("check", str(local))  # control: the config itself has none
    assert code == 0 and "one typo" not in out, out


def test_no_grpo_config_of_ours_or_of_nemo_rls_trees_holds_one():
    trees = nemo_rl_upstream_trees()
    assert len(trees) >= 2, f"NeMo-RL's trees not found at {NEMO_RL_UPSTREAM}"
    files = sorted(glob.glob(str(REPO / "examples/configs/**/*.yaml"), recursive=True))
    for tree in trees:
        files += sorted(glob.glob(str(tree / "examples/configs/**/*.yaml"), recursive=True))
    checked, found = 0, {}
    for f in files:
        try:  # as written (interpolations unresolved: such keys are left out of the parse)
            data = merged_container(f)
        except ConfigError:
            continue  # not loadable alone (a fragment): the sweep of every config covers it
        if "grpo" not in data or "policy" not in data:
            continue
        checked += 1
        found.update({f"{f}: {i.path}": i.message for i in near_misses(RunConfig, data)})
    assert checked >= 400 and not found, (checked, found)


@pytest.mark.parametrize(("a", "b", "n"), [("gpro", "grpo", 1), ("dpo", "grpo", 2)])
def test_typo_distance(a, b, n):
    from nemo_jetrl.config.typed import _typos

    assert _typos(a, b) == n


def test_a_cluster_launch_refuses_it_and_jetrl_not_typos_lets_a_meant_key_pass(cli, tmp_path):
    """At `jetrl train --backend nemo-rl` and `jetrl rehearse` (``run=True``) the typo would cost
    a cluster job run on the wrong value: an error there, naming the escape for a NeMo-RL key we
    do not know; `jetrl check` of the same config warns (control above)."""
    from nemo_jetrl.backends.nemo_rl.launch import prepare
    from nemo_jetrl.errors import UserError

    cluster = REPO / "examples/configs/qwen3_8b_base/jetrl.yaml"
    with pytest.raises(UserError) as err:
        prepare(str(cluster), ["++grpo.max_num_step=2"])
    msg = str(err.value)
    assert "grpo.max_num_step: unknown key, one typo from grpo.max_num_steps" in msg, msg
    assert "list it in jetrl.not_typos" in msg, msg
    code, out = cli("rehearse", cluster, "++grpo.max_num_step=2", "--workdir", tmp_path / "w")
    assert code == 2 and "grpo.max_num_step: unknown key, one typo" in out, out
    meant = ["++grpo.max_num_step=2", "++jetrl.not_typos=[grpo.max_num_step]"]
    prepare(str(cluster), meant)  # listed: the launch goes on
    code, out = cli("check", str(cluster), *meant)
    assert code == 0 and "one typo" not in out, out
    local = REPO / "examples/configs/local/jetrl.yaml"  # the local backend: the same escape
    code, out = cli("check", str(local), *meant)
    assert code == 0 and "one typo" not in out, out
    code, out = cli("check", str(local), "++grpo.max_num_step=2", "++jetrl.not_typos=[grpo.x]")
    assert code == 2 and "one typo" in out, out  # another key listed: still refused
