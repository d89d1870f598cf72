"""Issue 26: every GRPO config of the NeMo-RL tree under test gets a verdict that is true of it.

Walks every GRPO config under the tree's ``examples/`` (recipes, ModelOpt, nemo_gym, all of
them: not only FP8 ones), runs `jetrl check` on each and compares its verdict with a
classification computed independently from NeMo-RL's own resolved config
(tests/backends/nemo_rl_grpo_configs.py). No config gets ON-POLICY unless it is BF16 on both
sides with no policy lag; FP8, MXFP8 and ModelOpt configs never do; async GRPO has its lag named
(main's single-controller configs by their ``async_rl.sampler`` window).
FP8 mixture-of-experts and hybrid (Qwen3.5) configs are refused by name today, FP8 Nemotron-H
(Mamba layers) configs as state-space models: asserted, counted.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
from nemo_rl_grpo_configs import classify, grpo_configs, raw_declares_grpo, set_env_placeholders
from nemo_rl_upstream import tree_dir, tree_name

from nemo_jetrl.cli import main as jetrl

pytestmark = pytest.mark.nemo_rl

ON = "verdict: ON-POLICY: every rollout tensor equals its training-forward tensor"
LAG_HEAD = "verdict: OFF-POLICY by policy lag (precision flow: {})"
NOT_PROVEN = "verdict: NOT PROVEN ON-POLICY: precision keys this checker does not model"


def _verdict(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("verdict: ")]
    return lines[-1] if lines else ""


def _expect(exp, code: int, out: str, err: str) -> str:
    """Assert the check output against the classification; returns the outcome's label."""
    verdict = _verdict(out)
    if exp.state_space:  # Nemotron-H: no layer of it is described, whatever its MoE layers
        assert code == 2 and "\n  - policy.model_name: model with state-space layers" in err, err
        return "state-space refused"
    if exp.moe or exp.hybrid:
        kind = "moe" if exp.moe else "hybrid"
        if code == 2:  # refused by name: the error names a YAML key, no traceback
            assert "invalid config" in err and re.search(r"\n  - (policy|jetrl)\.", err), err
            return f"{kind} refused"
        # A hybrid model described by `arch` may get a verdict: never ON-POLICY (FP8 as shipped).
        assert code == 1 and verdict != ON, (code, verdict)
        return f"{kind} checked off-policy"
    assert code in (0, 1), (code, err)
    if exp.precision == "modelopt":
        assert code == 1 and verdict == NOT_PROVEN, verdict
        assert all(k in out for k in exp.quant_keys), (exp.quant_keys, out)
    elif exp.lag is not None:
        flow = "on-policy" if exp.precision == "bf16" else "OFF-POLICY"
        assert code == 1 and verdict == LAG_HEAD.format(flow), verdict
    elif exp.may_be_on_policy:
        assert code == 0 and verdict == ON, verdict
    else:
        assert code == 1 and verdict.startswith("verdict: OFF-POLICY ("), verdict
    if exp.lag is not None and exp.lag_key:  # the single controller's sampler window, named
        assert f"{exp.lag_key}={exp.lag}, " in out and "single-controller" in out, out
    elif exp.lag is not None:  # named with its age, whatever the precision
        assert "grpo.async_grpo.enabled=true" in out, out
        assert f"max_trajectory_age_steps={exp.lag}:" in out, out
    if exp.precision == "mxfp8_rollout" and exp.lag is None:
        assert "is_mx=true" in out and "1x32" in out, out
    if code == 0:
        assert exp.may_be_on_policy  # the one rule of the walk, stated once more
    return exp.precision + (" + lag" if exp.lag is not None else "")


SHARDS = 4  # one test per quarter of the configs: each stays well inside the 600 s per-test limit


@pytest.fixture(scope="module")
def walked(request) -> list:
    """(path, NeMo-RL's resolved config) of every GRPO config of the tree, read once."""
    mp = pytest.MonkeyPatch()
    request.addfinalizer(mp.undo)
    set_env_placeholders(mp)
    configs, unreadable = grpo_configs(tree_dir())
    # A file NeMo-RL's loader cannot read is no GRPO config (quantizer recipes, launcher files).
    assert not [p for p in unreadable if raw_declares_grpo(p)], unreadable
    return configs


@pytest.mark.slow
def test_the_walk_finds_every_kind_of_grpo_config(walked, capsys):
    """The walk is not vacuous: BF16, FP8, ModelOpt and async configs are all among them."""
    assert len(walked) >= 150, len(walked)  # v0.7.0: 189, main 7ea279a: 245
    kinds = Counter(classify(cfg).precision for _, cfg in walked)
    lagged = sum(classify(cfg).lag is not None for _, cfg in walked)
    with capsys.disabled():
        print(f"\nNeMo-RL {tree_name()}: {len(walked)} GRPO configs {dict(kinds)}, {lagged} async")
    assert kinds["bf16"] and kinds["modelopt"] and lagged
    assert kinds["fp8_both"] + kinds["fp8_rollout_bf16_train"] + kinds["mxfp8_rollout"] >= 5


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
def test_every_grpo_config_gets_a_true_verdict(shard, walked, monkeypatch, capsys):
    set_env_placeholders(monkeypatch)
    counts: Counter = Counter()
    wrong = []
    mine = walked[shard::SHARDS]
    for path, cfg in mine:
        exp = classify(cfg)
        code = jetrl(["check", str(path)])
        cap = capsys.readouterr()
        assert "Traceback" not in cap.out + cap.err, (path, cap.err)
        try:
            counts[_expect(exp, code, cap.out, cap.err)] += 1
        except AssertionError as exc:
            wrong.append(f"{path.relative_to(tree_dir())}: expected {exp}, exit {code}: {exc}")
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    with capsys.disabled():
        print(f"\nNeMo-RL {tree_name()} shard {shard}: {len(mine)} GRPO configs: {summary}")
    assert not wrong, "\n".join(wrong)
    assert sum(counts.values()) == len(mine) > 0
