"""Problems a config load finds are reported together, before any work (bad-input review,
session 41): every bad parent of a ``defaults:`` list, not only the first; a malformed override
with a missing file, not only after the file is mended; and an override key with an empty part
(``+policy..x=1`` wrote a key named "" that nothing reads) is refused, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_jetrl.config import ConfigError, load_config, load_valid_config
from nemo_jetrl.config.overrides import parse_override

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "examples/configs/qwen3_8b_base/jetrl.yaml"


def test_every_bad_parent_of_a_defaults_list_is_named(tmp_path, cli):
    (tmp_path / "dir.yaml").mkdir()
    cfg = tmp_path / "child.yaml"
    cfg.write_text("defaults: [gone1.yaml, dir.yaml, gone2.yaml]\ngrpo: {max_num_steps: 1}\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    found = [(i.path, i.message) for i in err.value.issues]
    assert len(found) == 3, found
    assert all(p == "defaults" for p, _ in found), found
    for name in ("gone1.yaml", "dir.yaml", "gone2.yaml"):
        assert sum(name in m for _, m in found) == 1, (name, found)
    assert "a directory, not a config file" in found[1][1], found
    code, out = cli("check", cfg)
    assert code == 2 and "3 problems" in out and "gone2.yaml" in out, out


def test_a_bad_parent_deeper_in_the_chain_is_named_with_a_sibling(tmp_path):
    (tmp_path / "mid.yaml").write_text("defaults: gone_deep.yaml\npolicy: {}\n")
    cfg = tmp_path / "child.yaml"
    cfg.write_text("defaults: [mid.yaml, gone_top.yaml]\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    text = str(err.value)
    assert "gone_deep.yaml" in text and "gone_top.yaml" in text, text


def test_a_malformed_override_is_named_with_a_missing_file(tmp_path, cli):
    missing = tmp_path / "missing.yaml"
    for load in (
        lambda: load_config(missing, ["noeq", "grpo.seed=1"]),
        lambda: load_valid_config(missing, ["noeq", "grpo.seed=1"]),
    ):
        with pytest.raises(ConfigError) as err:
            load()
        paths = [i.path for i in err.value.issues]
        assert paths == ["<file>", "<override>"], paths  # the good override is not an issue
        assert "'noeq' is not key=value" in str(err.value), err.value
    code, out = cli("check", missing, "noeq", "+policy..x=1")
    assert code == 2 and "config file not found" in out, out
    assert "'noeq' is not key=value" in out and "empty part" in out, out


@pytest.mark.parametrize("text", ["+policy..x=1", "policy.=1", ".grpo.seed=1", "~policy..x"])
def test_an_override_key_with_an_empty_part_is_refused(text):
    with pytest.raises(ValueError, match="has an empty part between dots"):
        parse_override(text)


def test_an_empty_key_part_never_reaches_the_config(cli):
    code, out = cli("check", CLUSTER, "+policy..x=1")
    assert code == 2 and "'+policy..x=1'" in out and "empty part" in out, out
    code, out = cli("check", CLUSTER, "+policy.x=1")  # control: the same key, well formed
    assert code == 0, out
