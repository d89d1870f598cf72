"""A verdict never claims more than the checker modelled: ModelOpt quantization-aware configs
(policy.quant_cfg / policy.generation.quant_cfg) are NOT PROVEN, async GRPO is OFF-POLICY by
policy lag, each naming its keys; on NeMo-RL's own configs of both trees where present."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import NEMO_RL_UPSTREAM

REPO = Path(__file__).resolve().parents[2]
JETRL_KV = REPO / "examples" / "configs" / "qwen3_8b_base" / "jetrl_kv.yaml"
UPSTREAM = NEMO_RL_UPSTREAM  # honours $JETRL_NEMO_RL_UPSTREAM (the mutation check's copies)


@pytest.mark.parametrize(
    "keys",
    [
        ["+policy.quant_cfg=nvfp4_a16.yaml"],
        ["+policy.generation.quant_cfg=nvfp4_a16.yaml"],
        ["+policy.quant_cfg=nvfp4_a16.yaml", "+policy.generation.quant_cfg=nvfp4_a16.yaml"],
    ],
)
def test_modelopt_quant_cfg_is_never_on_policy_and_is_named(cli, keys):
    code, out = cli("check", JETRL_KV, *keys)
    assert code == 1 and "verdict: NOT PROVEN ON-POLICY" in out and "verdict: ON-POLICY" not in out
    for k in keys:
        assert k.split("=")[0].lstrip("+") in out.split("keys:")[-1]
    code, out = cli("check", JETRL_KV, *keys, "--json")
    data = json.loads(out)
    assert code == 1 and data["on_policy"] is False and data["precision_on_policy"] is True
    assert [x["kind"] for x in data["limits"]] == ["unmodelled"]


@pytest.mark.parametrize(("age", "in_flight"), [(None, False), (2, False), (1, True)])
def test_async_grpo_is_off_policy_by_lag_with_precision_stated(cli, age, in_flight):
    extra = ["+grpo.async_grpo.enabled=true"]
    if age is not None:
        extra.append(f"+grpo.async_grpo.max_trajectory_age_steps={age}")
    if in_flight:
        extra.append("+grpo.async_grpo.in_flight_weight_updates=true")
    code, out = cli("check", JETRL_KV, *extra)
    assert code == 1
    assert "verdict: OFF-POLICY by policy lag (precision flow: on-policy)" in out
    assert f"max_trajectory_age_steps={age or 1}" in out
    assert ("grpo.async_grpo.in_flight_weight_updates" in out) == in_flight
    code, _ = cli("check", JETRL_KV, "+grpo.async_grpo.enabled=false")
    assert code == 0  # a synchronous run keeps its verdict


def test_off_policy_precision_and_lag_are_both_reported(cli):
    fp8_rollout = REPO / "examples" / "configs" / "qwen3_8b_base" / "fp8_rollout.yaml"
    code, out = cli("check", fp8_rollout, "+grpo.async_grpo.enabled=true")
    assert code == 1 and "policy lag (precision flow: OFF-POLICY)" in out and "keys:" in out


def test_train_refuses_unmodelled_quantization_unless_allowed(cli, tmp_path):
    local = REPO / "examples" / "configs" / "local" / "jetrl.yaml"
    code, out = cli("train", local, "+policy.generation.quant_cfg=x.yaml",
                    f"logger.log_dir={tmp_path / 'run'}")  # fmt: skip
    assert code == 2 and "policy.generation.quant_cfg" in out and "allow_off_policy" in out
    assert not (tmp_path / "run").exists()  # refused before any work


def test_train_refuses_policy_lag_as_check_calls_it_unless_allowed(cli):
    """``jetrl check`` calls async GRPO off-policy by policy lag (exit 1); ``jetrl train`` used
    to run it anyway (fd6dbfb), against docs/cluster.md's rule that it refuses what check calls
    off-policy unless ``jetrl.allow_off_policy=true``."""
    jetrl = REPO / "examples" / "configs" / "qwen3_8b_base" / "jetrl.yaml"
    code, out = cli("train", jetrl, "--backend", "nemo-rl", "+grpo.async_grpo.enabled=true")
    assert code == 2 and "off-policy by policy lag" in out, out
    assert "pass jetrl.allow_off_policy=true to run it anyway" in out
    code, out = cli("train", jetrl, "--backend", "nemo-rl", "+grpo.async_grpo.enabled=true",
                    "jetrl.allow_off_policy=true")  # fmt: skip
    assert "error: grpo.async_grpo.enabled=true, max_trajectory_age_steps" not in out, out


def _upstream_configs(pattern: str) -> list[Path]:
    return sorted(p for tree in ("v0.7.0", "main-7ea279a") for p in (UPSTREAM / tree).glob(pattern))


@pytest.mark.skipif(not UPSTREAM.is_dir(), reason="NeMo-RL's source (../shared/upstream) absent")
def test_nemo_rl_quantization_aware_and_async_configs_are_never_called_on_policy(cli):
    quantized = re.compile(r"^\s*quant_cfg:\s*(?!null\b)\S", re.MULTILINE)
    qa = [
        p for p in _upstream_configs("examples/**/*grpo*.yaml") if quantized.search(p.read_text())
    ]
    lag = [p for p in _upstream_configs("examples/nemo_gym/grpo_*swe*.yaml")]
    assert len(qa) >= 4 and lag, (qa, lag)
    for path in qa + lag:
        code, out = cli("check", path)
        assert "Traceback" not in out, path
        if code == 2:  # refused by name (e.g. MoE): also never on-policy
            continue
        assert code == 1 and "verdict: ON-POLICY" not in out, (path, out[-600:])
        assert "NOT PROVEN" in out or "policy lag" in out, path
