"""The loader's plain-container merge (`merge.merge_parts`) against OmegaConf's own merge, which
it stands in for: every case below, including those where OmegaConf resolves, keeps or refuses
something a key-by-key merge would not (the loader falls back to OmegaConf's merge there). Over
every YAML of both NeMo-RL trees the loaded configs were the same as with OmegaConf's merge
(659 files, 2026-11-30)."""

from __future__ import annotations

import copy

import pytest
from omegaconf import OmegaConf

from nemo_jetrl.config import merge

CASES = [
    ({"a": 1}, {"a": "???"}),  # missing never replaces a value
    ({"a": {"x": 1}}, {"a": "???"}),
    ({}, {"a": "???"}),  # ... but is kept where there was none
    ({"a": {"x": 1}}, {"a": {"x": "???"}}),
    ({"a": {"x": 1}}, {"a": None}),
    ({"a": {"x": 1}}, {"a": 5}),
    ({"a": 5}, {"a": {"x": 1}}),
    ({"a": None}, {"a": {"x": 1}}),
    ({"a": "???"}, {"a": {"x": 1}}),
    ({"a": [1, 2]}, {"a": [3]}),  # lists replace
    ({"a": {"x": 1}}, {"a": {}}),
    ({"a": {"x": {"y": 1}}}, {"a": {"x": None}}),
    ({"a": {"x": 1}}, {"a": "${b}", "b": {"y": 2}}),
    ({"a": "${b}", "b": {"y": 2}}, {"a": {"x": 1}}),  # OmegaConf merges into the resolved b
    ({"a": 1}, {"a": "${oc.env:HOME}"}),
    ({"s": {"a": 1, "b": 2}}, {"s": {"_override_": True, "c": 3}}),  # replaces the mapping
    ({"s": {"a": 1}}, {"s": {"_override_": False, "c": 3}}),  # merges, the flag kept
    ({"s": {"a": {"k": 1}}}, {"s": {"a": {"_override_": True, "j": 2}}}),  # only at the top
    # the fallback after the plain merge changed keys and popped a flag before giving up
    (
        {"p": {"x": 1}, "s": {"a": 1}, "z": "${b}", "b": {"y": 2}},
        {"p": {"w": 2}, "s": {"_override_": True, "c": 3}, "z": {"x": 1}},
    ),
]


def _omegaconf(parts: list[dict]) -> dict:
    merged = None
    for part in parts:
        merged = merge.merge_with_override(merged, OmegaConf.create(part))
    return OmegaConf.to_container(merged, resolve=False)


@pytest.mark.parametrize(("base", "child"), CASES)
def test_the_plain_merge_gives_omegaconfs_result(base, child):
    parts = [base, child]
    assert merge.merge_parts(copy.deepcopy(parts)) == _omegaconf(copy.deepcopy(parts))


@pytest.mark.parametrize(("base", "child"), [({"a": [1]}, {"a": {"x": 1}}),
                                             ({"a": {"x": 1}}, {"a": [1]})])  # fmt: skip
def test_a_list_meeting_a_mapping_is_refused_as_omegaconf_refuses_it(base, child):
    from omegaconf.errors import ConfigTypeError

    with pytest.raises(ConfigTypeError):
        merge.merge_parts([base, child])


def test_three_parts_merge_in_order_and_the_parts_are_the_callers():
    a, b, c = {"x": 1, "s": {"p": 1}}, {"x": 2, "s": {"q": 2}}, {"s": {"_override_": True, "r": 3}}
    assert merge.merge_parts([a, b, c]) == {"x": 2, "s": {"r": 3}}
