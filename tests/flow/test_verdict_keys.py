"""The YAML keys a verdict carries, as `jetrl check` prints them ("keys:" lines) and writes them
(``--json``): exact lists, in order, for each kind of mismatch and limit, not only the message.
A user fixes the run by these keys (and `jetrl align` reads the same lists), so a key dropped
from a list is a verdict that no longer says what to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_jetrl.config import schema as S

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs" / "qwen3_8b_base"
A = "grpo.async_grpo."

MISMATCHES = [
    ("fp8_rollout", [], [S.FP8_ENABLED, S.VLLM_PRECISION]),
    ("jetrl", [f"{S.VLLM_PRECISION}=bfloat16"], [S.VLLM_PRECISION, S.FP8_ENABLED]),
    ("jetrl_kv", [f"{S.VLLM_FIRST_BF16}=2"],
     [S.VLLM_FIRST_BF16, "jetrl.train_num_first_layers_in_bf16"]),
    ("jetrl_kv", [f"{S.VLLM_LAST_BF16}=2"],
     [S.VLLM_LAST_BF16, "jetrl.train_num_last_layers_in_bf16"]),
    ("jetrl_kv", ["jetrl.onpolicy_kv=false"], ["jetrl.onpolicy_kv", S.VLLM_KV_DTYPE]),
]  # fmt: skip


@pytest.mark.parametrize(("config", "overrides", "keys"), MISMATCHES)
def test_each_mismatch_carries_its_keys(cli, config, overrides, keys):
    path = CONFIGS / f"{config}.yaml"
    code, out = cli("check", path, *overrides, "--json")
    data = json.loads(out)
    assert code == 1 and [m["keys"] for m in data["mismatches"]] == [keys]
    code, out = cli("check", path, *overrides)
    assert code == 1 and f"   keys: {', '.join(keys)}\n" in out


def test_weight_and_activation_scale_mismatches_each_name_their_own_key(cli):
    path = CONFIGS / "jetrl_kv.yaml"
    code, out = cli("check", path, f"{S.VLLM_POW2_W}=false", "--json")
    data = json.loads(out)
    got = {m["reason"].split(" scales")[0]: m["keys"] for m in data["mismatches"]}
    assert code == 1 and got == {
        "weight": [S.VLLM_POW2_W, S.FP32_SCALES_KEY],
        "activation": [S.VLLM_POW2_A, S.FP32_SCALES_KEY],
    }


LIMITS = [
    ([f"+{A}enabled=true"], [("policy_lag", [f"{A}enabled", f"{A}max_trajectory_age_steps"])]),
    ([f"+{A}enabled=true", f"+{A}in_flight_weight_updates=true"],
     [("policy_lag", [f"{A}enabled", f"{A}max_trajectory_age_steps",
                      f"{A}in_flight_weight_updates"])]),
    ([f"+{A}enabled=true", f"+{A}in_flight_weight_updates=false"],
     [("policy_lag", [f"{A}enabled", f"{A}max_trajectory_age_steps"])]),
    (["+policy.generation.quant_cfg=a.yaml", "+policy.quant_cfg=b.yaml"],
     [("unmodelled", ["policy.quant_cfg", "policy.generation.quant_cfg"])]),
    (["+policy.quant_cfg=b.yaml", f"+{A}enabled=true"],
     [("unmodelled", ["policy.quant_cfg"]),
      ("policy_lag", [f"{A}enabled", f"{A}max_trajectory_age_steps"])]),
    (["+policy.generation.quant_cfg={}", f"+{A}enabled=false"], []),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "limits"), LIMITS)
def test_each_limit_carries_its_keys(cli, overrides, limits):
    path = CONFIGS / "jetrl_kv.yaml"
    code, out = cli("check", path, *overrides, "--json")
    data = json.loads(out)
    assert [(x["kind"], x["keys"]) for x in data["limits"]] == limits
    assert code == (1 if limits else 0) and data["on_policy"] == (not limits)
    code, out = cli("check", path, *overrides)
    lines = [ln.strip() for ln in out.splitlines() if ln.startswith("    keys: ")]
    assert lines == [f"keys: {', '.join(keys)}" for _, keys in limits]


def test_megatron_moe_keys_at_their_dense_defaults_are_no_moe_evidence(cli):
    """NeMo-RL's dense Megatron configs spell expert_model_parallel_size / expert_tensor_
    parallel_size = 1 (its defaults): an FP8 dense run keeps its ON-POLICY verdict; 2 is MoE
    evidence, refused by the key that says so."""
    path = CONFIGS / "jetrl_kv.yaml"
    keys = [f"++policy.megatron_cfg.{k}=1" for k in ("expert_model_parallel_size",
                                                     "expert_tensor_parallel_size")]  # fmt: skip
    code, out = cli("check", path, *keys)
    assert code == 0 and "verdict: ON-POLICY" in out
    code, out = cli("check", path, "++policy.megatron_cfg.expert_model_parallel_size=2")
    assert code == 2 and "policy.megatron_cfg.expert_model_parallel_size=2" in out
