"""The local GRPO loop with ``jetrl.local.rollout_engine: vllm`` (real vLLM CPU engine, patched).

Runs in the vLLM environment (scripts/test_vllm.sh). A 2-step run of the ``jetrl`` recipe at tiny
sizes (1-operation problems, 2x2 samples, 3-step warm start): the engine serves the repo's 2-layer
Llama from a run-local config + tokenizer directory, gets the trainer's weights by refit every
step (parity check on), and its per-token logprobs are the run's ``generation_logprobs``.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
from pathlib import Path

import pytest
from local_configs import tiny_cfg

pytestmark = pytest.mark.vllm

# Tensors read back per refit: every tensor sent; jetrl adds one weight_scale_inv per FP8
# projection (2 decoder layers x 7 projections).
EXTRA_SCALE_TENSORS = {"jetrl": 14, "bf16": 0, "jetrl_kv": 14}
# How far the vLLM rollout is from the HF trainer: |token_mult_prob_error - 1| and the largest
# per-token |generation - prev| logprob gap of each step. The BF16 recipe's run (module fixture
# `bf16_run`, same CPU, same pytest run, same engine and trainer, no FP8) is the control of the FP8
# recipes' runs: FP8 value < PER_BF16 x the control's worst step + floor. Measured, |tmpe - 1|:
# AVX2 0.0094-0.0101 (jetrl) against 0.0016-0.0024 (bf16); AMX (vLLM 0.32) 0.0088-0.0118 (jetrl)
# and 0.016-0.018 (jetrl_kv, whose FP8 KV cache rounds K/V on top) against 0.0014-0.0015: ratio
# up to 12. Gap: AMX 0.026-0.038 (jetrl), 0.040-0.084 (jetrl_kv) against 0.0072 nats: ratio up
# to 12. Floors: about half the smallest jetrl value. The FP8 weights are bit-identical (parity
# read-back on every refit). The BF16 run itself, being the control, keeps fixed sanity bounds:
# 0.03 and 0.5 nats (well above its 0.0014-0.0024 and 0.004-0.007) still catch a wrong model,
# wrong temperature or misaligned logprobs (errors of 2x and more).
CONTROL_TMPE_BOUND, CONTROL_GAP_BOUND = 0.03, 0.5
PER_BF16, TMPE_FLOOR, GAP_FLOOR = 20.0, 0.005, 0.02


# Fresh engines (issue 40): each local run starts its own engine (run_local owns it, with the
# recipe's engine arguments) and _run_on_vllm_engine checks it is gone after the run.
@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """The control: ``[(|tmpe - 1|, largest logprob gap)]`` per step of the bf16 recipe's run."""
    return _run_on_vllm_engine(tmp_path_factory.mktemp("bf16_control"), "bf16")


def _check_against_control(recipe: str, steps, control) -> None:
    c_tmpe, c_gap = max(t for t, _ in control), max(g for _, g in control)
    tmpe_bound, gap_bound = PER_BF16 * c_tmpe + TMPE_FLOOR, PER_BF16 * c_gap + GAP_FLOOR
    for step, (tmpe, gap) in enumerate(steps, 1):
        print(f"{recipe} step {step}: |tmpe-1| {tmpe:.6f} (control {c_tmpe:.6f}), "
              f"gap {gap:.4f} nats (control {c_gap:.4f})")  # fmt: skip
        assert tmpe < tmpe_bound, (
            f"{recipe} step {step}: |token_mult_prob_error - 1| = {tmpe:.6f}, more than "
            f"{tmpe_bound:.6f} from the bf16 run's {c_tmpe:.6f}"
        )
        assert gap < gap_bound, (
            f"{recipe} step {step}: generation vs prev logprobs differ by {gap:.4f} nats, more "
            f"than {gap_bound:.4f} from the bf16 run's {c_gap:.4f}"
        )


def _cfg(recipe: str, log_dir: Path, cache_dir: Path, *extra: str):
    return tiny_cfg(recipe, log_dir, cache_dir, "jetrl.local.rollout_engine=vllm", *extra)


# One home per fact (issue 40): the local loop around the engine is the same on every vLLM line;
# the engine parts it drives (VllmRolloutEngine's refit with parity every step, generate with
# logprobs, close) run on 0.20 in tests/vllm_patch/test_vllm_engine.py. What differs by line here
# (jetrl_kv and fp8_rollout refused on 0.20) stays unmarked below.
ONE_LINE = pytest.mark.vllm_versions(
    "0.32", why="local loop: same code on every vLLM line; engine parts: test_vllm_engine"
)


@ONE_LINE
@pytest.mark.parametrize("recipe", ["jetrl", "bf16"])
def test_local_run_on_vllm_engine(tmp_path, recipe, bf16_run):
    if recipe == "bf16":  # the control run (the fixture), with fixed sanity bounds
        for step, (tmpe, gap) in enumerate(bf16_run, 1):
            print(f"bf16 step {step}: |tmpe-1| {tmpe:.6f}, gap {gap:.4f} nats")
            assert tmpe < CONTROL_TMPE_BOUND and gap < CONTROL_GAP_BOUND, (step, tmpe, gap)
        return
    _check_against_control(recipe, _run_on_vllm_engine(tmp_path, recipe), bf16_run)


def test_jetrl_kv_on_the_vllm_engine_where_vllm_runs_fp8_kv_here(tmp_path, request):
    """jetrl_kv end to end where the installed vLLM runs an FP8 KV cache on this CPU (0.25+ on
    AVX-512/AMX); elsewhere the config is refused before anything starts, with vLLM's reason."""
    from nemo_jetrl.backends.local.loop import resolve_run
    from nemo_jetrl.config import ConfigError
    from nemo_jetrl.vllm_patch.compat import cpu_fp8_kv_cache

    ok, why = cpu_fp8_kv_cache()
    if ok:
        steps = _run_on_vllm_engine(tmp_path, "jetrl_kv")
        _check_against_control("jetrl_kv", steps, request.getfixturevalue("bf16_run"))
        return
    with pytest.raises(ConfigError) as ei:
        resolve_run(_cfg("jetrl_kv", tmp_path, tmp_path))
    msgs = [(i.path, i.message) for i in ei.value.issues]
    assert any(
        p == "jetrl.local.rollout_engine" and "uses an FP8 KV cache" in m and why in m
        for p, m in msgs
    ), msgs


def _run_on_vllm_engine(tmp_path, recipe) -> list[tuple[float, float]]:
    """A 2-step run on the vLLM engine, checked; per step, |tmpe - 1| and the largest
    |generation - prev| logprob gap (bounded by the callers)."""
    from nemo_jetrl.backends.local.loop import Hooks, resolve_run, run_local
    from nemo_jetrl.backends.local.refit import export_weights
    from nemo_jetrl.vllm_patch.settings import ENV_VAR

    before = {p.pid for p in multiprocessing.active_children()}  # other modules' engines
    runs, steps = [], []
    hooks = Hooks(on_run=runs.append, after_step=lambda step, s: steps.append((step, dict(s))))
    log_dir = tmp_path / "run"
    res = run_local(
        resolve_run(_cfg(recipe, log_dir, tmp_path / "cache")),
        progress=False,
        hooks=hooks,
        log=print,
    )
    assert res.last_step == 2 and [s for s, _ in steps] == [1, 2]
    (run,) = runs
    n_tensors = len(export_weights(run.trainer.model))
    # the engine served the run-local model dir: config (with architectures) + tokenizer only
    model_dir = log_dir / "vllm_model"
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    assert (model_dir / "tokenizer.json").is_file()
    assert not list(model_dir.glob("*.safetensors"))
    # the first load, step 1's, the validation after step 1 (an update came: step 2 uses that
    # refit) and the validation after step 2 (val_period 1: the final policy is measured)
    assert run.engine.refits == 4
    result = []
    for step, s in steps:
        bad = {k: v for k, v in s.items() if not math.isfinite(v)}
        assert not bad, f"step {step}: non-finite metrics {bad}"
        assert s["jetrl/local/refit_refused"] == 0.0
        assert s["jetrl/local/vllm_parity_tensors"] == n_tensors + EXTRA_SCALE_TENSORS[recipe]
        if recipe == "jetrl_kv":  # the trainer's calibrated scales, set and read back
            assert s["jetrl/local/vllm_kv_layers"] == 2.0, step
        tmpe = s["train/token_mult_prob_error"]
        assert "validation/accuracy" in s
        # the rollout's logprobs came from vLLM: close to the trainer's, but not its bits
        rows = [
            json.loads(line)
            for line in (log_dir / f"train_data_step{step}.jsonl").read_text().splitlines()
        ]
        assert len(rows) == 4
        gen, prev = [], []
        for r in rows:  # NeMo-RL's layout: every field is a list with one entry per sample
            m = r["token_loss_mask"][0]
            gen += [g for g, k in zip(r["generation_logprobs"][0], m, strict=True) if k]
            prev += [p for p, k in zip(r["prev_logprobs"][0], m, strict=True) if k]
        assert gen and all(math.isfinite(g) and g <= 0.0 for g in gen)
        assert gen != prev
        result.append((abs(tmpe - 1.0), max(abs(g - p) for g, p in zip(gen, prev, strict=True))))
    assert list(log_dir.rglob("events.out.tfevents.*")), "no TensorBoard event file"
    # closed at the end: engine gone, patch reverted, no engine process left
    assert run.engine.closed
    assert ENV_VAR not in os.environ
    left = [p for p in multiprocessing.active_children() if p.pid not in before]
    for p in left:  # vLLM's shutdown sends SIGTERM and may return before the process is gone
        p.join(timeout=30)
    left = [p for p in left if p.is_alive()]
    assert not left, f"engine processes still alive after the run: {left}"
    return result


@pytest.mark.parametrize(
    ("recipe", "extra", "needle"),
    [
        ("fp8_rollout", (), "recipe 'fp8_rollout' runs FP8 rollout linears with vLLM's own"),
        ("jetrl", ("jetrl.local.dtype=float32",), "set jetrl.local.dtype=bfloat16"),
    ],
)
def test_recipes_the_cpu_engine_cannot_run_are_refused(tmp_path, recipe, extra, needle):
    from nemo_jetrl.backends.local.loop import resolve_run
    from nemo_jetrl.config import ConfigError

    with pytest.raises(ConfigError) as ei:
        resolve_run(_cfg(recipe, tmp_path, tmp_path, *extra))
    msgs = [(i.path, i.message) for i in ei.value.issues]
    assert any(p == "jetrl.local.rollout_engine" and needle in m for p, m in msgs), msgs


@pytest.mark.vllm_versions("0.32", why="config validation only: no vLLM code runs")
def test_unknown_rollout_engine_names_key_and_choices(tmp_path):
    from nemo_jetrl.backends.local.config import validate_local_config

    (issue,) = validate_local_config({"rollout_engine": "sglang"})
    assert issue.path == "jetrl.local.rollout_engine"
    assert "'sglang'" in issue.message and "(allowed: hf, vllm)" in str(issue)
