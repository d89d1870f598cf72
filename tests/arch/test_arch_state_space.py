"""Models with state-space (Mamba) layers: never read as a transformer, refused with FP8 by name
(exit 2, naming the key), checked in BF16 on Nemotron-H's own layers (`arch.mamba`) or on a
stand-in (arch/state_space.py, flow/support.py).

Before this rule a Nemotron-H config.json was read as a dense decoder with attention and MoE in
every layer (`model.layers.0.mlp.experts.down_proj`), and a Nemotron Nano v2 name got a generic
stand-in and an ON-POLICY FP8 verdict, to be refused only by NeMo-RL's policy worker on the
cluster (Megatron-Bridge's provider keeps its first and last layer BF16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from local_configs import refused_issues

from nemo_jetrl.arch import ArchError, ModelArch, StateSpaceArch, builtin_arch
from nemo_jetrl.arch.state_space import name_is_state_space, state_space_evidence
from nemo_jetrl.cli import main as jetrl
from nemo_jetrl.config import ConfigError
from nemo_jetrl.flow.pipeline import check_config

EX = Path(__file__).resolve().parents[2] / "examples" / "configs"
E2E = EX / "nemo_rl_fp8_e2e.yaml"  # FP8 on both sides, a Llama model
BF16_ROLLOUT = ["policy.generation.vllm_cfg.precision=bfloat16"]
BF16 = [*BF16_ROLLOUT, "policy.megatron_cfg.fp8_cfg.enabled=false"]


@pytest.fixture(scope="module")
def nemotron_h_json(tmp_path_factory) -> Path:
    """config.json of a small Nemotron-H (Mamba, MoE, attention, MLP layers) as transformers'
    own NemotronHConfig writes it."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.NemotronHConfig(
        hybrid_override_pattern="ME*-ME",
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        mamba_num_heads=8,
        mamba_head_dim=64,
        n_routed_experts=4,
        moe_intermediate_size=256,
        moe_shared_expert_intermediate_size=256,
        vocab_size=512,
    )
    path = tmp_path_factory.mktemp("nemotron_h") / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return path


def test_a_nemotron_h_config_json_is_read_as_its_mixers_others_are_refused(nemotron_h_json):
    data = json.loads(nemotron_h_json.read_text())
    assert data["model_type"] == "nemotron_h" and len(data["layers_block_type"]) == 6
    arch = ModelArch.from_json(nemotron_h_json)  # one mixer per layer (tests/arch/...nemotron_h)
    assert arch.mamba is not None and arch.mamba.pattern == "ME*-ME"
    assert not [x for x in arch.linears() if ".mlp." in x.name or ".self_attn." in x.name]
    jamba = {**data, "model_type": "jamba"}
    with pytest.raises(StateSpaceArch, match=r"model_type='jamba'\) has state-space layers"):
        ModelArch.from_hf_config(jamba)
    path = nemotron_h_json.parent / "jamba" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(jamba))
    with pytest.raises(StateSpaceArch, match=r"model config .*config\.json: config of") as exc:
        ModelArch.from_json(path)
    assert isinstance(exc.value, ArchError) and exc.value.key == "jetrl.model_config"


@pytest.mark.parametrize(
    ("extra", "evidence"),
    [
        ({"hybrid_override_pattern": "M-M-M*-M-M-M*-M-M-M-M-M*-"}, "hybrid_override_pattern="),
        ({"layers_block_type": ["mamba", "attention"]}, "layers_block_type=[2 layer types]"),
        ({"mamba_d_state": 16}, "mamba_d_state=16"),
        ({"text_config": {"model_type": "jamba"}}, "model_type='jamba'"),
    ],
)
def test_state_space_keys_are_evidence_whatever_the_model_type(extra, evidence):
    cfg = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 512,
        "intermediate_size": 512,
        **extra,
    }
    found = state_space_evidence(cfg)
    assert found is not None and found.startswith(evidence), found
    with pytest.raises(StateSpaceArch):
        ModelArch.from_hf_config(cfg)


def test_the_transformer_families_are_still_read():
    # Qwen3.5 (gated linear attention, with layer_types) and Qwen3-Next are not state-space
    for name in (
        "Qwen/Qwen3.5-9B",
        "Qwen/Qwen3.5-35B-A3B",
        "Qwen/Qwen3-30B-A3B",
        "Qwen/Qwen3-8B-Base",
    ):
        arch = builtin_arch(name)
        assert arch is not None and state_space_evidence(arch.hf_config or {}) is None, name
        assert ModelArch.from_hf_config(arch.to_hf_config()).num_layers == arch.num_layers


@pytest.mark.parametrize(
    ("name", "ssm"),
    [
        ("nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16", True),
        ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16", True),
        ("nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16", True),
        ("nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16", True),
        ("nvidia/NVIDIA-Nemotron-Nano-12B-v2", True),
        ("nvidia/NVIDIA-Nemotron-Nano-9B-v2", True),
        ("nvidia/Nemotron-H-8B-Base-8K", True),
        ("ai21labs/AI21-Jamba-Mini-1.7", True),
        ("tiiuae/Falcon-H1-7B-Instruct", True),
        ("state-spaces/mamba2-2.7b", True),
        ("ibm-granite/granite-4.0-h-small", True),
        # Llama-based Nemotrons: transformers the flow reads
        ("nvidia/Llama-3.1-Nemotron-Nano-8B-v1", False),
        ("nvidia/Llama-3_3-Nemotron-Super-49B-v1_5", False),
        ("nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1", False),
        ("nvidia/OpenReasoning-Nemotron-7B", False),
        ("ibm-granite/granite-3.3-8b-instruct", False),
        ("Qwen/Qwen3-30B-A3B", False),
        (None, False),
    ],
)
def test_names_of_state_space_families(name, ssm):
    assert name_is_state_space(name) is ssm


def _refused(*overrides: str) -> list:
    with pytest.raises(ConfigError) as exc:
        check_config(str(E2E), list(overrides))
    return exc.value.issues


def test_fp8_on_a_state_space_name_is_refused_naming_the_model_key():
    issues = _refused("policy.model_name=nvidia/NVIDIA-Nemotron-Nano-12B-v2")
    assert len(issues) == 1, issues  # no "set jetrl.model_config" note: it would not help
    (only,) = issues
    assert only.path == "policy.model_name" and only.level == "error"
    assert "(a Mamba hybrid family)) with FP8" in only.message
    assert "policy.megatron_cfg.fp8_cfg.enabled=false" in only.message
    # an MoE name is refused once, as state-space, not also as an MoE without a description
    (moe,) = _refused("policy.model_name=nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16")
    assert moe.path == "policy.model_name" and "state-space layers" in moe.message
    # the FP8 rollout alone is enough
    (roll,) = _refused(
        "policy.model_name=nvidia/NVIDIA-Nemotron-Nano-9B-v2",
        "policy.megatron_cfg.fp8_cfg.enabled=false",
    )
    assert "with FP8" in roll.message


COUNTED = "model_type='nemotron_h': 6 layers, 2 Mamba-2, 1 attention, 1 MLP, 2 MoE) with FP8"


def test_fp8_with_a_state_space_config_json_is_refused_naming_that_key(nemotron_h_json):
    (only,) = _refused(f"+jetrl.model_config={nemotron_h_json}")
    assert only.path == "jetrl.model_config"
    assert f"(jetrl.model_config {COUNTED}" in only.message
    assert "has not matched the rollout's and the trainer's Mamba-2 mixers" in only.message
    # the described layers' words are checked as any model's: self_attn names nothing here
    words = "+jetrl.train_bf16_layer_kws=[self_attn.q_proj]"
    with pytest.raises(ConfigError, match=r"names like model\.layers\.0\.mixer\.in_proj"):
        check_config(str(E2E), [f"+jetrl.model_config={nemotron_h_json}", words])


def test_bf16_on_a_state_space_model_is_checked_on_its_layers_or_a_stand_in(nemotron_h_json):
    c = check_config(str(E2E), [*BF16, f"+jetrl.model_config={nemotron_h_json}"])
    assert c.on_policy and c.arch.mamba is not None and c.arch_note is None
    groups = {e.group for e in c.check.rollout.edges}
    assert {"mamba", "attn", "mlp", "experts"} <= groups and "linear_attn" not in groups
    assert sorted({e.layer for e in c.check.rollout.edges if e.group == "kv"}) == [2]
    (local,) = [b for b in c.backends if b.backend == "local"]
    assert not local.runs and "Mamba-2 layers" in local.reason  # no local verdict
    c = check_config(str(E2E), [*BF16, "policy.model_name=nvidia/NVIDIA-Nemotron-Nano-12B-v2"])
    assert c.on_policy and c.arch.name == "<generic aligned model>"
    assert (
        c.arch_note.startswith("model with state-space layers (")
        and "nothing to align" in c.arch_note
    )
    assert not [i for i in c.issues if "no built-in description" in i.message], c.issues


def test_jetrl_check_and_align_exit_2_writing_nothing(tmp_path, capsys, nemotron_h_json):
    name = "policy.model_name=nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16"
    assert jetrl(["check", str(E2E), name]) == 2
    err = capsys.readouterr().err
    assert (
        "invalid config" in err and "\n  - policy.model_name: model with state-space layers" in err
    )
    out = tmp_path / "aligned.yaml"
    given = f"+jetrl.model_config={nemotron_h_json}"
    assert jetrl(["align", str(E2E), "-o", str(out), given]) == 2
    err = capsys.readouterr().err
    assert "\n  - jetrl.model_config: model with state-space layers" in err and not out.exists()
    assert jetrl(["check", str(E2E), *BF16, name]) == 0
    assert "verdict: ON-POLICY" in capsys.readouterr().out


def test_the_local_backend_refuses_a_state_space_model_it_would_build(tmp_path, nemotron_h_json):
    # never a generic stand-in where the model is built: one error, naming the local key
    issues = refused_issues(tmp_path, f"jetrl.local.model_config={nemotron_h_json}")
    message = issues.get("jetrl.local.model_config", "")
    assert "model_type 'nemotron_h'" in message and "not supported by the local" in message
    jamba = tmp_path / "jamba.json"
    jamba.write_text(json.dumps({**json.loads(nemotron_h_json.read_text()), "model_type": "jamba"}))
    issues = refused_issues(tmp_path, f"jetrl.local.model_config={jamba}")
    assert "'jamba'" in issues.get("jetrl.local.model_config", ""), issues


def test_a_local_model_directory_with_state_space_layers_is_refused_with_fp8(nemotron_h_json):
    # policy.model_name may be a checkpoint directory: its config.json is the evidence
    (only,) = _refused(f"policy.model_name={nemotron_h_json.parent}")
    assert only.path == "policy.model_name"
    assert f"(policy.model_name {COUNTED}" in only.message
    c = check_config(str(E2E), [*BF16, f"policy.model_name={nemotron_h_json.parent}"])
    assert c.on_policy and c.arch.mamba is not None and c.arch_note is None
    # a family arch does not describe (Jamba): its directory's config.json is the evidence
    jamba = nemotron_h_json.parent / "jamba-dir" / "config.json"
    jamba.parent.mkdir(exist_ok=True)
    jamba.write_text(json.dumps({**json.loads(nemotron_h_json.read_text()), "model_type": "jamba"}))
    (only,) = _refused(f"policy.model_name={jamba.parent}")
    assert "(policy.model_name model_type='jamba') with FP8" in only.message
    assert "does not describe its Mamba mixers" in only.message
    c = check_config(str(E2E), [*BF16, f"policy.model_name={jamba.parent}"])
    assert c.on_policy and "state-space layers (policy.model_name model_type=" in c.arch_note
