"""Per-backend verdicts (flow/backend.py), refusals by name (flow/support.py), NeMo-RL's
resolvers (config/resolvers.py) in the default environment (NeMo-RL absent: our equivalents)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_jetrl.cli import main as jetrl
from nemo_jetrl.config import ConfigError, load_config
from nemo_jetrl.flow.pipeline import check_config

EX = Path(__file__).resolve().parents[2] / "examples" / "configs"
E2E = EX / "nemo_rl_fp8_e2e.yaml"  # FP32 scales on both sides


def _verdicts(*overrides: str) -> dict[str, tuple[bool, str]]:
    c = check_config(str(E2E), list(overrides))
    return {b.backend: (b.on_policy, b.reason) for b in c.backends}


def test_fp32_without_refit_hook_is_off_policy_on_nemo_rl_only(capsys):
    v = _verdicts("jetrl.vllm_patch=true", "+jetrl.refit_hook=false")
    assert v["local"][0] is True
    on, why = v["nemo-rl v0.7.0"]
    assert not on and why.startswith("FP32 scales on NeMo-RL v0.7.0 without our refit hook")
    code = jetrl(["check", str(E2E), "jetrl.vllm_patch=true", "+jetrl.refit_hook=false"])
    out = capsys.readouterr().out
    assert code == 1 and "verdict: OFF-POLICY on nemo-rl v0.7.0, nemo-rl main" in out


def test_refit_hook_makes_fp32_on_policy_everywhere():
    v = _verdicts("jetrl.vllm_patch=true")  # refit_hook defaults to true
    assert all(on for on, _ in v.values()), v
    assert "our refit hook" in v["nemo-rl main"][1]


def test_pow2_without_hook_is_on_policy_except_v070_fp8_kv():
    qwen = EX / "qwen3_8b_base"
    c = check_config(str(qwen / "jetrl.yaml"), ["+jetrl.refit_hook=false"])
    assert c.on_policy
    kv = check_config(str(qwen / "jetrl_kv.yaml"), ["+jetrl.refit_hook=false"])
    by = {b.backend: b for b in kv.backends}
    assert not by["nemo-rl v0.7.0"].on_policy and by["nemo-rl main"].on_policy
    assert "KV scales" in by["nemo-rl v0.7.0"].reason


@pytest.mark.parametrize(
    ("override", "key", "needle"),
    [
        (
            "+policy.megatron_cfg.expert_model_parallel_size=4",
            "jetrl.model_config",
            "(policy.megatron_cfg.expert_model_parallel_size=4) with FP8: the flow has no description",
        ),
        (
            "policy.model_name=Qwen/Qwen3-30B-A3B policy.generation.vllm_cfg.tensor_parallel_size=4",
            "policy.generation.vllm_cfg.tensor_parallel_size",
            "splits each expert's width 768 into 192 per rank, not a multiple of 128",
        ),
    ],
)
def test_fp8_moe_refused_naming_what_is_not_covered(override, key, needle):
    """What no backend runs yet is refused by its key (a dense model with Megatron's expert keys
    is one the flow cannot describe)."""
    with pytest.raises(ConfigError) as exc:
        check_config(str(E2E), override.split())
    msg = str(exc.value)
    assert "mixture-of-experts model" in msg and needle in msg and "mlp.experts" in msg
    assert key in msg


def test_fp8_moe_without_shared_experts_checks_per_backend(monkeypatch):
    """Routed experts run our experts computation on both sides: the flow verdict holds on every
    backend, as the experts kernel covers both NeMo-RL trees' vLLM (v0.7.0: 0.20.0, main: 0.25.1);
    a tree on a release it does not cover is named off, with the release."""
    from nemo_jetrl.flow import backend

    args = ["policy.model_name=Qwen/Qwen3-30B-A3B", "jetrl.vllm_patch=true"]
    c = check_config(str(E2E), args)
    assert c.check.on_policy  # the flow: every rollout tensor equals its training tensor
    by = {b.backend: b for b in c.backends}
    assert all(b.on_policy for b in by.values()), by
    assert "our refit hook" in by["nemo-rl main"].reason
    monkeypatch.setitem(backend.NEMO_RL_VLLM, "main", "0.33.0")  # no CPU build: not covered
    by = {b.backend: b for b in check_config(str(E2E), args).backends}
    assert by["nemo-rl v0.7.0"].on_policy and not by["nemo-rl main"].on_policy
    assert "vLLM 0.33.0" in by["nemo-rl main"].reason and "0.25.1" in by["nemo-rl main"].reason


@pytest.mark.parametrize(
    ("model", "extra"),
    [
        ("moonshotai/Moonlight-16B-A3B-Instruct", ["++jetrl.unaligned_layers=bf16"]),
        ("Qwen/Qwen3.5-35B-A3B-Base", ["++jetrl.unaligned_layers=bf16"]),
    ],
)
def test_fp8_moe_with_shared_experts_is_not_refused(model, extra):
    """Shared experts (DeepSeek's shared_experts, Qwen's shared_expert + shared_expert_gate)
    run on each side's dense quantizer: the flow holds them the same, nothing is refused."""
    from nemo_jetrl.flow.graph import same_numbers

    c = check_config(str(E2E), [f"policy.model_name={model}", "jetrl.vllm_patch=true", *extra])
    assert c.arch.moe.shared_size > 0
    shared = [e for e in c.check.rollout.edges if e.group == "shared_experts"]
    fwd = c.check.train_fwd.by_key()
    assert shared and all(same_numbers(fwd[e.key].precision, e.precision) for e in shared)
    assert any(e.precision.is_fp8 for e in shared)


def test_bf16_moe_is_not_refused():
    bf16 = EX / "qwen3_8b_base" / "bf16.yaml"
    assert check_config(str(bf16), ["policy.model_name=Qwen/Qwen3-30B-A3B"]).on_policy


def test_quantization_ignored_layer_kws_outside_the_flow_refused_by_name(capsys):
    key = "policy.generation.vllm_cfg.quantization_ignored_layer_kws"
    code = jetrl(["check", str(E2E), f"+{key}=[a_proj,b_proj]"])
    err = capsys.readouterr().err
    assert code == 2 and key in err and "['a_proj', 'b_proj'] match no decoder linear" in err
    assert "Traceback" not in err


def test_nemo_rl_resolvers_resolve(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        f"defaults: {E2E}\npolicy:\n  logprob_batch_size: ${{mul:2,3}}\n"
        "  train_micro_batch_size: ${div:8,4}\n  generation_batch_size: ${max:3,5}\n"
    )
    cfg = load_config(p)
    pol = cfg.policy
    assert (pol.logprob_batch_size, pol.train_micro_batch_size, pol.generation_batch_size) == (
        6,
        2.0,
        5,
    )


def test_align_keeps_a_per_name_list_of_flow_linears_on_both_sides(tmp_path, capsys):
    key = "policy.generation.vllm_cfg.quantization_ignored_layer_kws"
    out = tmp_path / "a.yaml"
    code = jetrl(
        ["align", str(E2E), f"+{key}=[q_proj,k_proj,v_proj]", "--recipe", "jetrl", "-o", str(out)]
    )
    printed = capsys.readouterr().out
    assert code == 0 and "jetrl.train_bf16_layer_kws" in printed and "ON-POLICY" in printed
    cfg = load_config(out)
    assert list(cfg.policy.generation.vllm_cfg.quantization_ignored_layer_kws) == [
        "q_proj",
        "k_proj",
        "v_proj",
    ]
    assert list(cfg.jetrl.train_bf16_layer_kws) == ["q_proj", "k_proj", "v_proj"]
    code = jetrl(["align", str(E2E), f"+{key}=[linear_attn.conv1d]", "-o", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2 and "linear_attn.conv1d" in err and "match no decoder linear" in err


def test_nemo_rl_launch_refuses_fp32_without_refit_hook():
    from nemo_jetrl.backends.nemo_rl.launch import prepare
    from nemo_jetrl.errors import UserError

    with pytest.raises(UserError, match="without our refit hook: weights differ"):
        prepare(str(E2E), ["jetrl.vllm_patch=true", "+jetrl.refit_hook=false"])
    assert prepare(str(E2E), ["jetrl.vllm_patch=true"]).plan.recipe.rollout.quantizer == "jetrl"
