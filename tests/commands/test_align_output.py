"""`jetrl align -o`: never a file of the input's `defaults:` chain, a directory said to be one
first, nothing created on a refusal, and the written file checked before it replaces anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_jetrl.errors import UserError

EX = Path(__file__).resolve().parents[2] / "examples" / "configs"


@pytest.fixture
def family(tmp_path):
    """a/parent.yaml (inheriting the shipped e2e config) and a/child.yaml inheriting it."""
    a = tmp_path / "a"
    a.mkdir()
    (a / "parent.yaml").write_text(f"defaults: {EX / 'nemo_rl_fp8_e2e.yaml'}\ngrpo:\n  seed: 3\n")
    (a / "child.yaml").write_text("defaults: parent.yaml\ngrpo:\n  seed: 7\n")
    return a


@pytest.mark.parametrize("as_child", [False, True])
def test_output_in_the_defaults_chain_is_refused_and_nothing_written(cli, family, as_child):
    parent = family / "parent.yaml"
    before = parent.read_bytes()
    link = family.parent / "link.yaml"
    link.symlink_to(parent)  # the same file by another name
    for target in (parent, link):
        argv = ["align", family / "child.yaml", "-o", target, "--force"]
        code, out = cli(*argv, *(["--as-child"] if as_child else []))
        assert code == 2, out
        assert (
            f"-o {target} is {parent}, a file of {family / 'child.yaml'}'s defaults: chain" in out
        )
        assert "wrote" not in out
        assert parent.read_bytes() == before and link.is_symlink()
    code, out = cli("check", family / "child.yaml")
    assert code in (0, 1), out


def test_output_is_the_input_refused_even_without_force(cli, family):
    child = family / "child.yaml"
    before = child.read_bytes()
    code, out = cli("align", child, "-o", child)
    assert code == 2 and f"-o {child} is the input file" in out and "--force" not in out
    assert child.read_bytes() == before


def test_a_directory_is_said_to_be_one_first(cli, family):
    for force in ([], ["--force"]):
        code, out = cli("align", family / "child.yaml", "-o", family, *force)
        assert code == 2 and f"-o {family} is a directory; give the file to write" in out, out


def test_a_refused_input_creates_no_directory(cli, family, tmp_path):
    code, out = cli("align", tmp_path / "bad.yaml", "-o", tmp_path / "new" / "sub" / "o.yaml")
    assert code == 2 and "config file not found" in out
    assert not (tmp_path / "new").exists()
    deep = tmp_path / "new" / "sub" / "o.yaml"  # a good input: made, written, no temp file left
    code, out = cli("align", family / "child.yaml", "-o", deep, "--as-child")
    assert code in (0, 1) and f"wrote {deep}" in out and "verdict:" in out, out
    assert [p.name for p in deep.parent.iterdir()] == ["o.yaml"]


def test_a_file_failing_its_check_replaces_nothing(tmp_path):
    """The check runs on a temporary file beside OUT; an invalid result is exit 2 said of OUT,
    OUT keeps its bytes, and neither the temporary file nor a directory made for it stays."""
    from nemo_jetrl.commands.align import _write_checked

    out = tmp_path / "out.yaml"
    out.write_text("old: 1\n")
    with pytest.raises(UserError, match=f"named in defaults: of {out}") as exc:
        _write_checked(out, "defaults: missing_parent.yaml\n")
    assert "config file not found" in str(exc.value) and f"nothing written to {out}" in str(
        exc.value
    )
    assert out.read_text() == "old: 1\n" and [p.name for p in tmp_path.iterdir()] == ["out.yaml"]
    deep = tmp_path / "new" / "sub" / "o.yaml"
    with pytest.raises(UserError):
        _write_checked(deep, "defaults: missing_parent.yaml\n")
    assert not (tmp_path / "new").exists()
