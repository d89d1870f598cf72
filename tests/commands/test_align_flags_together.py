"""`jetrl align`'s flag problems and the config's, reported together before anything is written
(bad-input review, session 41: `-o` over an existing file hid a missing config, and
``--kv`` with ``--recipe`` was named only once the config loaded)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "examples/configs/qwen3_8b_base/fp8_rollout.yaml"


def test_every_flag_problem_is_named_with_the_configs(cli, tmp_path):
    out = tmp_path / "a.yaml"
    out.write_text("mine: 1\n")
    missing = tmp_path / "nope.yaml"
    code, text = cli("align", missing, "-o", out, "--kv", "bf16", "--recipe", "jetrl")
    assert code == 2, text
    assert "3 problems, nothing written" in text, text
    assert "--kv bf16 with --recipe jetrl" in text, text
    assert "exists; pass --force" in text, text
    assert "config file not found" in text and str(missing) in text, text
    assert out.read_text() == "mine: 1\n"  # nothing lost
    code, text = cli("align", CLUSTER, "-o", out, "--kv", "bf16", "--recipe", "jetrl")
    assert code == 2 and "2 problems, nothing written" in text, text  # a good config: the flags
    assert "config file not found" not in text, text
    code, text = cli("align", CLUSTER, "-o", out, "--recipe", "jetrl", "--force")  # control
    assert code == 0, text
    assert "jetrl" in out.read_text()


def test_a_config_align_itself_mends_is_not_blamed_beside_a_flag(cli, tmp_path):
    """A linear blockwise FP8 cannot tile (down_proj in_features 12296, not a multiple of 16)
    makes `check` refuse the config, and align keeps it BF16 by name. With `-o` over an existing
    file as well, only the flag is the problem: the config is not called invalid (review,
    session 43: align raised both before its own retry)."""
    import json

    model = tmp_path / "config.json"
    model.write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "hidden_size": 4096,
                "intermediate_size": 12296,
                "num_hidden_layers": 2,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": 151936,
                "max_position_embeddings": 40960,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False,
            }
        )
    )
    cfg = REPO / "examples/configs/qwen3_8b_base/jetrl.yaml"
    out = tmp_path / "aligned.yaml"
    out.write_text("mine: 1\n")
    given = f"+jetrl.model_config={model}"
    code, text = cli("check", cfg, given)
    assert code != 0 and "is not a multiple of 16" in text, text  # the config check refuses it
    code, text = cli("align", cfg, given, "-o", out)
    assert code == 2, text
    assert "exists; pass --force" in text, text
    assert "invalid config" not in text and "multiple of 16" not in text, text
    assert out.read_text() == "mine: 1\n"  # nothing lost
    code, text = cli("align", cfg, given, "-o", out, "--force")  # control: the flag mended
    assert code == 0, text
    assert "down_proj" in out.read_text(), out.read_text()
