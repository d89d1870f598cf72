"""Nemotron-H (`arch.mamba`) against transformers 5's real NemotronH, weight for weight: every
parameter of each tiny model is one of arch's linears with the same name and shape, or excluded
by a stated rule (norms, the Mamba mixer's per-head vectors, the embedding lookup); the sizes
of Nemotron 3 Nano are checked against the figures its model card states."""

from __future__ import annotations

import pytest
from test_arch_hf import assert_matches_real

from nemo_jetrl.arch import ArchError, ModelArch
from nemo_jetrl.arch.moe import per_expert_linears

transformers = pytest.importorskip("transformers")


def _tiny(**kw) -> dict:
    """Every mixer kind: Mamba, MLP, attention, experts (with shared experts)."""
    return {
        "model_type": "nemotron_h",
        "hidden_size": 256,
        "vocab_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "mamba_num_heads": 8,
        "mamba_head_dim": 32,
        "n_groups": 2,
        "ssm_state_size": 16,
        "intermediate_size": 384,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "moe_shared_expert_intermediate_size": 256,
        "hybrid_override_pattern": "M-*EME",
        **kw,
    }


def test_every_mixer_kind_matches_the_real_model():
    arch = assert_matches_real(_tiny())
    assert arch.family == "mamba-moe"
    assert arch.num_layers == 6 and arch.kv_layers() == [2]  # one attention layer
    assert arch.moe is not None and arch.moe.moe_layers == {3, 5}
    in_proj = arch.layer_linears(0)[0]
    # z and x (8 heads x 32), B and C (2 groups x 16 states each), dt (8 heads)
    assert (in_proj.name, in_proj.out_features) == ("model.layers.0.mixer.in_proj", 584)
    assert [lin.kind for lin in arch.layer_linears(1)] == ["up_proj", "down_proj"]
    assert {lin.group for lin in arch.layer_linears(4)} == {"mamba"}
    assert arch.layer_linears(0)[1].bf16_why is not None  # conv1d: never FP8


def test_layers_block_type_and_biases():
    words = ["linear_attention", "full_attention", "mlp", "linear_attention"]
    cfg = _tiny(use_bias=True, mlp_bias=True, use_conv_bias=False, layers_block_type=words)
    del cfg["hybrid_override_pattern"]
    arch = assert_matches_real(cfg)
    assert arch.family == "mamba" and arch.moe is None
    assert arch.mamba is not None and arch.mamba.pattern == "M*-M"


def test_latent_experts_of_nemotron_3_super():
    arch = assert_matches_real(_tiny(moe_latent_size=128))
    kinds = [lin.kind for lin in arch.layer_linears(3)]
    assert kinds[:4] == ["gate", "fc1_latent_proj", "up_proj", "down_proj"]
    up = arch.layer_linears(3)[2]
    assert (up.experts, up.out_features, up.in_features) == (4, 128, 128)  # reads the latent
    assert [x.name for x in per_expert_linears(up)][:2] == [
        "model.layers.3.mixer.experts.0.up_proj",
        "model.layers.3.mixer.experts.1.up_proj",
    ]


def test_older_spellings_of_the_pattern_words():
    cfg = _tiny(layers_block_type=["mamba", "attention", "mlp", "moe"])
    del cfg["hybrid_override_pattern"]
    assert ModelArch.from_hf_config(cfg).mamba.pattern == "M*-E"


# Nemotron 3 Nano 30B-A3B's config.json (the hub's, the figures the model card states: 52
# layers, 23 Mamba-2, 23 MoE, 6 attention; 128 routed experts, top-6, one shared expert).
NANO3 = {
    "model_type": "nemotron_h",
    "hidden_size": 2688,
    "vocab_size": 131072,
    "num_hidden_layers": 52,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "intermediate_size": 1856,
    "n_routed_experts": 128,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
}


def test_nemotron_3_nano_sizes():
    arch = ModelArch.from_hf_config(NANO3)
    counts = {c: arch.mamba.pattern.count(c) for c in "ME*"}
    assert counts == {"M": 23, "E": 23, "*": 6}
    in_proj = arch.layer_linears(0)[0]
    # 2*4096 + 2*8*128 + 64 = 10304 rows: 80.5 blocks of 128, a partial last block
    assert (in_proj.out_features, in_proj.in_features, in_proj.aligned) == (10304, 2688, False)
    total = arch.num_params()
    assert 31.0e9 < total < 32.5e9, total  # the card: 31.6B total


def test_bad_patterns_name_the_key():
    with pytest.raises(ArchError, match="hybrid_override_pattern='MX'"):
        ModelArch.from_hf_config(_tiny(hybrid_override_pattern="MX"))
    with pytest.raises(ArchError, match="no attention layer"):
        ModelArch.from_hf_config(_tiny(hybrid_override_pattern="M-M"))
    with pytest.raises(ArchError, match="num_hidden_layers=7 but the pattern has 6"):
        ModelArch.from_hf_config(_tiny(num_hidden_layers=7))
    with pytest.raises(ArchError, match="mamba_num_heads is missing"):
        cfg = _tiny()
        del cfg["mamba_num_heads"]
        ModelArch.from_hf_config(cfg)


def test_nemo_rl_configs_name_nemotron_3_nano_and_get_its_layers():
    from pathlib import Path

    from nemo_jetrl.arch import builtin_arch
    from nemo_jetrl.flow.pipeline import check_config

    for name in (
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16",
    ):
        arch = builtin_arch(name)
        assert arch is not None and arch.linears() == ModelArch.from_hf_config(NANO3).linears()
    e2e = Path(__file__).resolve().parents[2] / "examples" / "configs" / "nemo_rl_fp8_e2e.yaml"
    bf16 = [
        "policy.generation.vllm_cfg.precision=bfloat16",
        "policy.megatron_cfg.fp8_cfg.enabled=false",
        f"policy.model_name={name}",
    ]
    c = check_config(str(e2e), bf16)
    assert c.on_policy and c.arch_note is None and c.arch.family == "mamba-moe"
    kv = sorted({e.layer for e in c.check.rollout.edges if e.group == "kv"})
    assert kv == [5, 12, 19, 26, 33, 42]  # the six attention layers of its pattern


def test_nemotron_3_super_reads_its_latent_experts():
    from nemo_jetrl.arch import builtin_arch

    arch = builtin_arch("nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16")
    assert arch is not None and arch.num_layers == 88
    assert {c: arch.mamba.pattern.count(c) for c in "ME*"} == {"M": 40, "E": 40, "*": 8}
    assert 120.0e9 < arch.num_params() < 121.0e9  # the card: 120B total
    moe = next(i for i in range(88) if arch.is_moe_layer(i))
    by_kind = {x.kind: x for x in arch.layer_linears(moe)}
    assert (by_kind["fc1_latent_proj"].in_features, by_kind["fc1_latent_proj"].out_features) == (
        4096,
        1024,
    )
    (up,) = [x for x in arch.layer_linears(moe) if x.kind == "up_proj" and x.experts]
    assert (up.experts, up.out_features, up.in_features) == (512, 2688, 1024)
    assert by_kind["fc1_latent_proj"].group == "moe_latent"
