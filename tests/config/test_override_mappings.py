"""A mapping value in an override merges into the section it names, as Hydra (NeMo-RL's
`parse_hydra_overrides`) does (review, session 41: ``grpo={max_num_steps: 2}`` replaced the whole
``grpo`` section, so `jetrl align` wrote a config without the base's seed, batch and period and
a local run took every other grpo key's default). A key the section lacks is refused (Hydra
refuses it too), and ``{a:1}``, a key "a:1" to YAML, asks for the space Hydra does not need.
The same overrides through NeMo-RL's own function: the ``nemo_rl`` test below."""

from __future__ import annotations

import pytest
import yaml
from omegaconf import OmegaConf

from nemo_jetrl.config.issues import ConfigError
from nemo_jetrl.config.overrides import apply_overrides

BASE = {"grpo": {"max_num_steps": 16, "seed": 3, "env": None, "sub": {"a": 1, "b": 2}}}
MERGED = {  # override -> the config after it (NeMo-RL's result too)
    "grpo={max_num_steps: 2}": {**BASE["grpo"], "max_num_steps": 2},
    "grpo={sub: {a: 7}}": {**BASE["grpo"], "sub": {"a": 7, "b": 2}},
    "grpo.sub={b: 9}": {**BASE["grpo"], "sub": {"a": 1, "b": 9}},
    "grpo.env={X: 1}": {**BASE["grpo"], "env": {"X": 1}},  # a null is replaced whole
    "+grpo.new={a: 1}": {**BASE["grpo"], "new": {"a": 1}},
    "++grpo.sub={c: 5}": {**BASE["grpo"], "sub": {"a": 1, "b": 2, "c": 5}},
}
REFUSED = {  # override -> what the message says (NeMo-RL refuses each too)
    "grpo={newsub: {x: 1}}": "grpo.newsub is not in config; use +grpo.newsub=",
    "grpo={sub: {z: 7}}": "grpo.sub.z is not in config; use +grpo.sub.z=",
    "grpo.sub={c: 5}": "grpo.sub.c is not in config",
    "grpo={a:1}": "write {a: 1} with a space after the colon",
}


def _apply(override: str) -> dict:
    cfg = OmegaConf.create(BASE)
    return OmegaConf.to_container(apply_overrides(cfg, [override]))  # type: ignore[return-value]


@pytest.mark.parametrize("override", sorted(MERGED))
def test_a_mapping_merges_into_the_section(override):
    assert _apply(override) == {"grpo": MERGED[override]}


@pytest.mark.parametrize("override", sorted(REFUSED))
def test_a_key_the_section_lacks_is_refused_naming_it(override):
    with pytest.raises(ConfigError, match="override") as exc:
        _apply(override)
    assert REFUSED[override] in str(exc.value)


def test_refusals_are_reported_together_with_the_others():
    cfg = OmegaConf.create(BASE)
    with pytest.raises(ConfigError) as exc:
        apply_overrides(cfg, ["grpo={a:1}", "grpo={sub: {z: 7}}", "grpo.nope=1"])
    assert len(exc.value.issues) == 3


def test_align_keeps_the_base_keys_of_a_merged_section(tmp_path, cli):
    from conftest import REPO

    src = REPO / "examples/configs/qwen3_8b_base/jetrl.yaml"
    out = tmp_path / "out.yaml"
    code, text = cli("align", str(src), "grpo={max_num_steps: 2}", "-o", str(out))
    assert code == 0, text
    grpo = yaml.safe_load(out.read_text())["grpo"]
    assert grpo["max_num_steps"] == 2
    assert {"num_prompts_per_step", "seed", "val_period"} <= set(grpo), grpo


@pytest.mark.nemo_rl
def test_nemo_rls_own_overrides_agree():
    from nemo_rl.utils.config import parse_hydra_overrides

    for override, want in MERGED.items():
        theirs = parse_hydra_overrides(OmegaConf.create(BASE), [override])
        assert OmegaConf.to_container(theirs) == {"grpo": want}, override
    for override in REFUSED:
        with pytest.raises(Exception, match="override"):
            parse_hydra_overrides(OmegaConf.create(BASE), [override])
