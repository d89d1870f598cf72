"""NeMo-RL main's single-controller async GRPO (``grpo.async_grpo: null``, run by
``examples/run_grpo_single_controller.py``) lags by its ``async_rl.sampler``: the verdict is
OFF-POLICY by policy lag naming the sampler's window key and what to set, as for the legacy
``grpo.async_grpo`` (`nemo_jetrl.flow.limits`); a window of 0 (NeMo-RL's own on-policy case,
``PromptGroupSampler.is_on_policy``) keeps the precision verdict. On main's own configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import NEMO_RL_UPSTREAM

REPO = Path(__file__).resolve().parents[2]
MAIN = NEMO_RL_UPSTREAM / "main-7ea279a" / "examples" / "configs"  # $JETRL_NEMO_RL_UPSTREAM
LLM = MAIN / "recipes" / "llm"
JETRL_KV = REPO / "examples" / "configs" / "qwen3_8b_base" / "jetrl_kv.yaml"
LAG = "verdict: OFF-POLICY by policy lag (precision flow: on-policy)"
ON = "verdict: ON-POLICY: every rollout tensor equals its training-forward tensor"
STALENESS = "async_rl.sampler.max_staleness_versions"
LOOKAHEAD = "async_rl.sampler.max_lookahead_versions"

needs_main = pytest.mark.skipif(not MAIN.is_dir(), reason="NeMo-RL main's source absent")


@needs_main
@pytest.mark.parametrize(
    ("name", "sampler", "key"),
    [
        ("grpo-llama3.1-8b-instruct-2n8g-async-1off-single-controller-streaming2", "windowed",
         STALENESS),
        ("grpo-llama3.1-8b-instruct-2n4g-async-1off-single-controller-streaming2", "windowed",
         STALENESS),
        ("grpo-qwen3-30ba3b-10n8g-megatron-cp2-r3-async-single-controller", "windowed",
         STALENESS),
        ("grpo-llama3.1-8b-instruct-2n8g-ready-first-single-controller", "ready_first",
         STALENESS),
        ("../../grpo_math_1B_megatron_single_controller", "in_order", LOOKAHEAD),
    ],
)  # fmt: skip
def test_single_controller_configs_are_off_policy_by_lag(cli, name, sampler, key):
    """These were ON-POLICY (exit 0): their sampler trains on trajectories 1 version old."""
    path = LLM / f"{name}.yaml"
    code, out = cli("check", path)
    assert code == 1 and LAG in out and ON not in out, out[-800:]
    assert f"async_rl.sampler.name={sampler!r}, {key}=1, " in out
    assert f"set {key}=0 for an on-policy run" in out
    assert f"keys: async_rl.sampler.name, {key}" in out
    code, out = cli("check", path, "--json")
    data = json.loads(out)
    assert code == 1 and data["on_policy"] is False and data["precision_on_policy"] is True
    assert [(x["kind"], x["keys"]) for x in data["limits"]] == [
        ("policy_lag", ["async_rl.sampler.name", key])
    ]
    code, out = cli("check", path, f"{key}=0")  # NeMo-RL's on-policy window
    assert code == 0 and ON in out, out[-800:]


@needs_main
@pytest.mark.parametrize("nodes", ["1n8g", "1n4g"])
def test_single_controller_sync_configs_stay_on_policy(cli, nodes):
    """in_order with max_lookahead_versions: 0: no lag (NeMo-RL's "sync" recipes)."""
    path = LLM / f"grpo-qwen2.5-math-1.5b-instruct-{nodes}-megatron-single-controller-sync.yaml"
    code, out = cli("check", path)
    assert code == 0 and ON in out and "policy lag" not in out, out[-800:]
    code, out = cli("check", path, f"{LOOKAHEAD}=2")
    assert code == 1 and LAG in out and f"{LOOKAHEAD}=2, " in out and "2 versions old" in out


@needs_main
def test_the_window_key_is_the_named_samplers_and_defaults_are_nemo_rls(cli):
    path = LLM / "grpo-llama3.1-8b-instruct-2n8g-async-1off-single-controller-streaming2.yaml"
    # in_order reads max_lookahead_versions: the streaming config's max_staleness_versions=0
    # does not bound it, and its default (1) applies
    code, out = cli("check", path, "async_rl.sampler.name=in_order", f"{STALENESS}=0")
    assert code == 1 and f"{LOOKAHEAD}=1 (NeMo-RL's default), " in out, out[-800:]
    code, out = cli("check", path, "~async_rl.sampler")  # AsyncRLConfig's default sampler
    assert code == 1 and "async_rl.sampler.name='in_order', " in out, out[-800:]
    # the advice pastes as printed: the default window's key is absent, so "+" (review)
    assert f"set +{LOOKAHEAD}=0 for an on-policy run" in out
    code, out = cli("check", path, "~async_rl.sampler", f"+{LOOKAHEAD}=0")
    assert code == 0 and ON in out, out[-800:]
    code, out = cli("check", path, "async_rl.sampler.name=weight_fifo")
    assert code == 1 and f"name='weight_fifo', {STALENESS}=1, " in out
    code, out = cli("check", path, "async_rl.sampler.name=custom", "+async_rl.sampler.target=m:S")
    assert code == 1 and LAG in out and "target='m:S'" in out  # its window is its own code's
    assert "keys: async_rl.sampler.name, async_rl.sampler.target" in out


def test_async_rl_is_read_only_on_the_single_controller_path(cli):
    """The legacy trainer (grpo.async_grpo given or absent) never reads async_rl; with
    ``grpo.async_grpo: null`` an absent async_rl reads as NeMo-RL's defaults."""
    code, out = cli("check", JETRL_KV, "+async_rl.sampler.name=windowed")
    assert code == 0 and ON in out, out[-800:]
    code, out = cli("check", JETRL_KV, "++grpo.async_grpo=null")
    assert code == 1 and LAG in out and f"{LOOKAHEAD}=1 (NeMo-RL's default)" in out
    code, out = cli("check", JETRL_KV, "++grpo.async_grpo=null", f"+{LOOKAHEAD}=0")
    assert code == 0 and ON in out, out[-800:]


def test_sampler_keys_are_typed_and_other_async_rl_keys_pass(cli):
    code, out = cli(
        "check", JETRL_KV, "+async_rl.sampler.name=windowd", f"+{STALENESS}=-1",
        "+async_rl.max_buffered_rollouts=64", "+async_rl.stall_watchdog.stall_action=warn",
    )  # fmt: skip
    assert code == 2 and "Traceback" not in out
    assert "async_rl.sampler.name: got 'windowd'" in out and "ready_first" in out
    assert f"{STALENESS}: got -1" in out
    assert "max_buffered_rollouts" not in out and "stall_watchdog" not in out
    code, out = cli("check", JETRL_KV, "+async_rl=[1]")
    assert code == 2 and "async_rl: got [1]; expected a mapping" in out


def test_train_refuses_single_controller_lag_as_check_calls_it(cli):
    jetrl = REPO / "examples" / "configs" / "qwen3_8b_base" / "jetrl.yaml"
    code, out = cli("train", jetrl, "--backend", "nemo-rl", "++grpo.async_grpo=null")
    assert code == 2 and "off-policy by policy lag" in out and LOOKAHEAD in out, out
    assert "pass jetrl.allow_off_policy=true to run it anyway" in out


def test_the_allow_override_pastes_into_a_config_without_jetrl_section(cli):
    """NeMo-RL's own config has no ``jetrl:``: the refusal said ``set jetrl.allow_off_policy=true``,
    which exits 2 there (an unknown key needs ``+``); it prints the override that pastes."""
    grpo = MAIN / "grpo_math_1B.yaml"
    code, out = cli("train", grpo, "--backend", "nemo-rl", "++grpo.async_grpo=null")
    assert code == 2 and "Or pass +jetrl.allow_off_policy=true to run it anyway" in out, out
    code, out = cli("train", grpo, "--backend", "nemo-rl", "++grpo.async_grpo=null",
                    "+jetrl.allow_off_policy=true")  # fmt: skip
    # past the gate: the next refusal is the DTensor policy's (grpo_math_1B trains without Megatron)
    assert "off-policy by policy lag" not in out and "unknown key" not in out, out
    assert "policy.megatron_cfg.enabled: the nemo-rl backend trains with Megatron-Core" in out
