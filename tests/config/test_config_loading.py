"""Config loading: `defaults` inheritance (relative and absolute paths, later wins, the
``_override_`` marker, errors), the file cache, and ``--set`` overrides."""

from __future__ import annotations

import pytest
from config_files import (
    EXAMPLES,
    write,
)
from omegaconf import OmegaConf

from nemo_jetrl.config import (
    ConfigError,
    apply_overrides,
    load_config,
    parse_override,
)

# ------------------------------------------------------------------------------ inheritance


def test_defaults_chain_with_relative_paths(tmp_path):
    write(tmp_path / "a" / "grand.yaml", "x: 1\ny: {p: 1, q: 1}\nz: ${x}\n")
    write(tmp_path / "a" / "b" / "parent.yaml", "defaults: ../grand.yaml\ny: {q: 2}\n")
    child = write(tmp_path / "c" / "child.yaml", "defaults: ../a/b/parent.yaml\nx: 3\n")
    cfg = load_config(child)
    assert OmegaConf.to_container(cfg, resolve=True) == {"x": 3, "y": {"p": 1, "q": 2}, "z": 3}
    assert "defaults" not in cfg


def test_defaults_list_later_wins_and_absolute_paths(tmp_path):
    p1 = write(tmp_path / "p1.yaml", "k: 1\nonly1: true\n")
    write(tmp_path / "p2.yaml", "k: 2\n")
    child = write(tmp_path / "child.yaml", f"defaults:\n  - {p1}\n  - p2.yaml\n")
    cfg = load_config(child)
    assert cfg.k == 2 and cfg.only1 is True
    child2 = write(tmp_path / "child2.yaml", "defaults: [p1.yaml, p2.yaml]\nk: 9\n")
    assert load_config(child2).k == 9


def test_override_marker_replaces_a_section(tmp_path):
    write(tmp_path / "p.yaml", "s: {a: 1, b: 2}\n")
    child = write(tmp_path / "c.yaml", "defaults: p.yaml\ns: {_override_: true, c: 3}\n")
    assert OmegaConf.to_container(load_config(child)) == {"s": {"c": 3}}


def test_inheritance_errors(tmp_path):
    write(tmp_path / "a.yaml", "defaults: b.yaml\n")
    write(tmp_path / "b.yaml", "defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="inheritance cycle"):
        load_config(tmp_path / "a.yaml")
    write(tmp_path / "m.yaml", "defaults: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"missing\.yaml.*named in defaults: of"):
        load_config(tmp_path / "m.yaml")
    write(tmp_path / "bad.yaml", "a: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot parse YAML"):
        load_config(tmp_path / "bad.yaml")
    write(tmp_path / "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(tmp_path / "list.yaml")


def test_a_file_read_once_is_reused_until_its_bytes_change(tmp_path, monkeypatch):
    """The loader keeps each file's inherited config (a tree walk reads the same bases hundreds
    of times): a second child of the same parent parses only itself, every caller gets its own
    copy, and an edit of the same size (a time stamp may not move) or a new cycle is seen."""
    from nemo_jetrl.config import load

    parsed: list[str] = []
    real = load._parse_file
    monkeypatch.setattr(load, "_parse_file", lambda p, d=None: parsed.append(p.name) or real(p, d))
    write(tmp_path / "grand.yaml", "x: 1\ns: {a: 1}\n")
    write(tmp_path / "parent.yaml", "defaults: grand.yaml\ny: 2\n")
    one = write(tmp_path / "one.yaml", "defaults: parent.yaml\nz: 3\n")
    two = write(tmp_path / "two.yaml", "defaults: parent.yaml\ns: {_override_: true, b: 2}\n")
    first = load_config(one)
    assert parsed == ["one.yaml", "parent.yaml", "grand.yaml"]
    first.x, first.s.a = 99, 99  # the caller's copy: the next load must not see it
    parsed.clear()
    assert OmegaConf.to_container(load_config(two)) == {"x": 1, "s": {"b": 2}, "y": 2}
    assert OmegaConf.to_container(load_config(one)) == {"x": 1, "s": {"a": 1}, "y": 2, "z": 3}
    assert parsed == ["two.yaml"]  # the parent's chain came from the first load
    write(tmp_path / "grand.yaml", "x: 5\ns: {a: 1}\n")  # same size, maybe the same mtime
    assert load_config(one).x == 5
    write(tmp_path / "grand.yaml", "defaults: one.yaml\n")
    with pytest.raises(ConfigError, match="inheritance cycle"):
        load_config(two)


# -------------------------------------------------------------------------------- overrides


def test_parse_override():
    assert parse_override("a.b=1") == ("set", "a.b", 1)
    assert parse_override("+a.c='1'") == ("add", "a.c", "1")
    assert parse_override("++a.d=null") == ("force", "a.d", None)
    assert parse_override("a=[1, 2]") == ("set", "a", [1, 2])
    assert parse_override("a=e4m3") == ("set", "a", "e4m3")
    assert parse_override("~a.b")[:2] == ("delete", "a.b")
    with pytest.raises(ValueError, match="not key=value"):
        parse_override("novalue")


def test_overrides_apply_in_order(tmp_path):
    cfg = OmegaConf.create({"a": {"b": 1, "c": 2}, "p": "${a.b}"})
    apply_overrides(cfg, ["a.b=5", "+a.new=x", "++a.c=3", "++z.y=1", "~a.new"])
    assert OmegaConf.to_container(cfg, resolve=True) == {
        "a": {"b": 5, "c": 3},
        "p": 5,
        "z": {"y": 1},
    }


def test_bad_overrides_are_reported_together():
    cfg = OmegaConf.create({"jetrl": {"vllm_patch": False}, "a": 1})
    with pytest.raises(ConfigError) as exc:
        apply_overrides(cfg, ["jetrl.vllm_pach=true", "+a=2", "~nope", "garbage"])
    msg = str(exc.value)
    assert "4 problems" in msg
    assert "did you mean jetrl.vllm_patch" in msg
    assert "use +jetrl.vllm_pach" in msg
    assert "already set; use a=" in msg
    assert "cannot delete" in msg
    assert "not key=value" in msg


def test_load_config_applies_overrides():
    cfg = load_config(EXAMPLES / "qwen3_8b_base" / "jetrl.yaml", ["jetrl.vllm_patch=false"])
    assert cfg.jetrl.vllm_patch is False
    assert cfg.policy.model_name == "Qwen/Qwen3-8B-Base"
