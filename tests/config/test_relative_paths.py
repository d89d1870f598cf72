"""A config's relative file paths are read from the working directory (as NeMo-RL reads its
own), not from the YAML file's: the shipped MoE configs name their model config from the
repository root. Run from elsewhere, the problem was named twice and did not say where the path
was looked for (review, session 39); now once, with the directory."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MOE = REPO / "examples/configs/local/moe/jetrl.yaml"


def test_a_relative_model_config_not_found_is_named_once_with_where_it_was_looked_for(
    cli, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    code, out = cli("check", str(MOE))
    assert code == 2, out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("- jetrl.local.model_config")]
    assert len(lines) == 1, out
    assert f"(relative to the working directory {tmp_path})" in lines[0], out
    code, out = cli("check", str(MOE), "jetrl.local.tokenizer=tok.json")
    assert f"file 'tok.json' not found (relative to the working directory {tmp_path})" in out
    monkeypatch.chdir(REPO)  # control: from the repository root the shipped config checks
    code, out = cli("check", str(MOE))
    assert code == 0, out


def test_a_tokenizer_directory_is_named_as_one_with_the_file_to_give(cli, tmp_path):
    """A HF tokenizer directory given as jetrl.local.tokenizer read "file not found" (bad-input
    review, session 41), though it is there: now it says it is a directory and names the
    tokenizer.json inside when there is one."""
    local = REPO / "examples/configs/local/jetrl.yaml"
    tok = tmp_path / "tok"
    tok.mkdir()
    code, out = cli("check", local, f"jetrl.local.tokenizer={tok}")
    assert code == 2 and "is a directory, not a tokenizers JSON file, with no tokenizer" in out, out
    assert "not found" not in out, out
    (tok / "tokenizer.json").write_text("{}")
    code, out = cli("check", local, f"jetrl.local.tokenizer={tok}")
    assert code == 2 and f"use '{tok / 'tokenizer.json'}'" in out, out
