"""scripts/nemo_rl_config_table.py's cheap read of a merged, unresolved config: a key set to a
plain reference to another key is followed in the container; every other interpolation is left
to OmegaConf (the NeMo-RL tier checks the whole table against NeMo-RL's own loader)."""

from __future__ import annotations

import pytest
from test_nemo_rl_config_table import _script  # the script as that tier's test loads it


@pytest.fixture(scope="module")
def table():
    return _script()


RAW = {
    "policy": {
        "precision": "fp8",
        "alias": "${policy.precision}",
        "generation": {"vllm_cfg": {"precision": "${policy.alias}", "kv_cache_dtype": "auto"}},
        "megatron": "${policy.generation}",
    },
}


def test_plain_references_are_followed_through_chains_and_on_the_way(table) -> None:
    assert table._plain_sel(RAW, "policy.generation.vllm_cfg.precision") == "fp8"
    assert table._plain_sel(RAW, "policy.megatron.vllm_cfg.kv_cache_dtype") == "auto"
    assert table._plain_sel(RAW, "policy.absent.key") is None
    assert table.fp8_summary(RAW, table._plain_sel) == "rollout FP8"


@pytest.mark.parametrize(
    "value",
    [
        "${mul:2,3}",  # a resolver
        "${oc.env:HF_HOME}",
        "${.precision}",  # relative
        "fp${policy.precision}",  # text around it
        "${policy.nowhere}",  # dangling: OmegaConf's error, not ours
        "${policy.generation.vllm_cfg.precision}",  # a cycle through itself
    ],
)
def test_every_other_interpolation_is_left_to_omegaconf(table, value) -> None:
    raw = {"policy": {"precision": "fp8", "generation": {"vllm_cfg": {"precision": value}}}}
    with pytest.raises(table._Interpolated):
        table._plain_sel(raw, "policy.generation.vllm_cfg.precision")
