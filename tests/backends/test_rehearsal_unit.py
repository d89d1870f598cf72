"""``jetrl rehearse``'s pieces that need no NeMo-RL: the tiny stand-in model of a config's family,
the prompts file, the keys a rehearsal sets, and the CLI's refusals before any work (the whole
rehearsal runs in the NeMo-RL tier: tests/backends/test_nemo_rl_rehearse.py)."""

from __future__ import annotations

import json

import pytest

from nemo_jetrl.arch.builtins import resolve_arch
from nemo_jetrl.backends.nemo_rl.rehearsal import model as tiny
from nemo_jetrl.backends.nemo_rl.rehearsal.run import _REMOVE, _set, rehearsal_keys


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("Qwen/Qwen3-8B-Base", "Qwen3ForCausalLM"),
        ("meta-llama/Llama-3.1-8B-Instruct", "LlamaForCausalLM"),
        ("Qwen/Qwen2.5-7B", "Qwen2ForCausalLM"),
    ],
)
def test_the_stand_in_is_the_real_family_in_whole_fp8_blocks(name, cls):
    arch = resolve_arch(name)
    assert arch is not None, name
    cfg = tiny.tiny_config(arch, vocab_size=128)
    assert cfg.architectures == [cls] and cfg.model_type == arch.model_type
    assert cfg.num_hidden_layers == tiny.LAYERS
    # q, k, v, o, gate/up, down: every dim whole 128-blocks (these models have no tail)
    assert cfg.hidden_size % 128 == 0 and cfg.intermediate_size % 128 == 0
    assert cfg.head_dim == 128 and cfg.hidden_size == cfg.num_attention_heads * cfg.head_dim
    grouped = arch.num_kv_heads < arch.num_heads
    assert (cfg.num_key_value_heads < cfg.num_attention_heads) == grouped
    assert cfg.tie_word_embeddings == arch.tie_word_embeddings


def test_a_real_tail_block_is_kept():
    arch = resolve_arch("Qwen/Qwen3-8B-Base")
    import dataclasses

    tail = dataclasses.replace(arch, intermediate_size=128 * 96 + 64)
    assert tiny.tiny_config(tail, 128).intermediate_size == 2 * 128 + 64


def test_families_without_a_stand_in_are_named():
    moe = resolve_arch("MiniMaxAI/MiniMax-M2")  # Qwen3-MoE has one: test_rehearsal_moe_unit.py
    with pytest.raises(tiny.UnsupportedFamily, match=r"mixture of experts.*qwen3_moe only"):
        tiny.tiny_config(moe, 128)


def test_tokenizer_prompts_and_keys(tmp_path):
    tok = tiny.build_tokenizer()
    text = "Think step-by-step: 12+15= \\boxed{27}"
    assert tok.decode(tok(text)["input_ids"]) == text  # every printable character is a token
    msgs = [{"role": "user", "content": "1+4="}]
    assert tok.apply_chat_template(msgs, tokenize=False) == "1+4="
    rows = [
        json.loads(x) for x in tiny.write_prompts(tmp_path / "p.jsonl").read_text().split("\n") if x
    ]
    assert len(rows) == tiny.PROMPTS and all(
        int(r["output"]) == eval(r["input"][:-1]) for r in rows
    )
    keys = rehearsal_keys(tmp_path, tmp_path / "m", tmp_path / "p.jsonl")
    tree = {
        "policy": {
            "tokenizer": {"name": "x", "chat_template": "default"},
            "generation": {"vllm_cfg": {"env_vars": {"USER_VAR": "kept"}}},
        },
        "data": {"train": 1},
    }
    for k, v in keys.items():
        _set(tree, k, v)
    assert "chat_template" not in tree["policy"]["tokenizer"]
    # vLLM eager, its CPU sampler included; the config's own worker variables kept
    vllm_cfg = tree["policy"]["generation"]["vllm_cfg"]
    assert vllm_cfg["enforce_eager"] is True
    assert vllm_cfg["env_vars"] == {"USER_VAR": "kept", "TORCH_COMPILE_DISABLE": "1"}
    assert tree["data"]["train"]["dataset_name"] == "ResponseDataset"
    assert keys["policy.tokenizer.chat_template"] is _REMOVE
    # enough rows for the checkpoint to fall on the last step (NeMo-RL: drop_last)
    assert keys["grpo.num_prompts_per_step"] * keys["grpo.max_num_steps"] <= tiny.PROMPTS


def test_rehearse_refuses_a_bad_config_before_any_work(tmp_path, capsys):
    from nemo_jetrl.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("jetrl:\n  recipe: nope\n")
    assert main(["rehearse", str(bad), "--workdir", str(tmp_path / "w")]) == 2
    assert "jetrl rehearse: error:" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_a_model_or_family_without_a_stand_in_is_named_before_any_work(tmp_path, capsys):
    """Config problems come before NeMo-RL is needed (this env has none): an unknown model
    names jetrl.model_config, a mixture of experts names its family."""
    from pathlib import Path

    from nemo_jetrl.cli import main

    repo = Path(__file__).resolve().parents[2]
    smoke = repo / "examples" / "configs" / "smoke" / "qwen3_1.7b_jetrl.yaml"
    unknown = "policy.model_name=example-org/Unknown-7B"
    assert main(["rehearse", str(smoke), unknown, "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "pass ++jetrl.model_config=PATH to the model's HF config.json" in err, err
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**resolve_arch("MiniMaxAI/MiniMax-M2").hf_config}))
    moe = [str(smoke), f"+jetrl.model_config={cfg}", "--workdir", str(tmp_path / "w")]
    assert main(["rehearse", *moe]) == 2
    # MiniMax-M2's sigmoid routing is named first: no NeMo-RL vLLM serves its FP8 experts
    assert "FP8 routed experts with sigmoid scores" in capsys.readouterr().err
    assert main(["rehearse", *moe, "jetrl.allow_off_policy=true"]) == 2
    assert "mixture of experts" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_a_bf16_model_with_mamba_layers_is_named_not_sent_for_a_config_json(tmp_path, capsys):
    """A BF16 Nemotron config passes the check on the stand-in; its rehearsal has no stand-in and
    must not ask for the config.json that arch refuses to read (session 47)."""
    from pathlib import Path

    from nemo_jetrl.cli import main

    repo = Path(__file__).resolve().parents[2]
    bf16 = repo / "examples" / "configs" / "qwen3_8b_base" / "bf16.yaml"
    nano = "policy.model_name=nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
    assert main(["rehearse", str(bf16), nano, "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "52 layers, 23 Mamba-2, 6 attention, 23 MoE) has state-space (Mamba)" in err, err
    v2 = "policy.model_name=nvidia/NVIDIA-Nemotron-Nano-12B-v2"  # not built in: by its name
    assert main(["rehearse", str(bf16), v2, "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "(a Mamba hybrid family)) has state-space (Mamba) layers" in err, err
    assert "jetrl.model_config=PATH" not in err and not (tmp_path / "w").exists()
    # its config.json is read (arch.mamba) and still has no stand-in: named by its layers
    cfg = tmp_path / "config.json"
    layers = {"hybrid_override_pattern": "M*-M", "mamba_num_heads": 8, "mamba_head_dim": 32}
    mamba = {**layers, "n_groups": 2, "ssm_state_size": 16, "intermediate_size": 512}
    dims = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "vocab_size": 512}
    cfg.write_text(json.dumps({"model_type": "nemotron_h", **dims, **mamba}))
    given = f"+jetrl.model_config={cfg}"
    assert main(["rehearse", str(bf16), given, "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "4 layers, 2 Mamba-2, 1 attention, 1 MLP) has state-space (Mamba) layers" in err, err
    assert not (tmp_path / "w").exists()
