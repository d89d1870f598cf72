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
# |token_mult_prob_error - 1| of the vLLM rollout vs the HF trainer on this tiny run: measured
# 0.0094-0.0101 (jetrl) and 0.0016-0.0024 (bf16) (vLLM's CPU attention and BF16 GEMMs are not
# HF's eager kernels; the FP8 weights are bit-identical). 0.03 is 3x the worst measured and still
# catches a wrong model, wrong temperature or misaligned logprobs (errors of 2x and more).
TMPE_BOUND = 0.03


def _cfg(recipe: str, log_dir: Path, cache_dir: Path, *extra: str):
    return tiny_cfg(recipe, log_dir, cache_dir, "jetrl.local.rollout_engine=vllm", *extra)


@pytest.mark.parametrize("recipe", ["jetrl", "bf16"])
def test_local_run_on_vllm_engine(tmp_path, recipe):
    _run_on_vllm_engine(tmp_path, recipe)


def test_jetrl_kv_on_the_vllm_engine_where_vllm_runs_fp8_kv_here(tmp_path):
    """jetrl_kv end to end where the installed vLLM runs an FP8 KV cache on this CPU (0.25+ on
    AVX-512/AMX); elsewhere the config is refused before anything starts, with vLLM's reason."""
    from nemo_jetrl.backends.local.loop import resolve_run
    from nemo_jetrl.config import ConfigError
    from nemo_jetrl.vllm_patch.compat import cpu_fp8_kv_cache

    ok, why = cpu_fp8_kv_cache()
    if ok:
        _run_on_vllm_engine(tmp_path, "jetrl_kv")
        return
    with pytest.raises(ConfigError) as ei:
        resolve_run(_cfg("jetrl_kv", tmp_path, tmp_path))
    msgs = [(i.path, i.message) for i in ei.value.issues]
    assert any(
        p == "jetrl.local.rollout_engine" and "uses an FP8 KV cache" in m and why in m
        for p, m in msgs
    ), msgs


def _run_on_vllm_engine(tmp_path, recipe):
    from nemo_jetrl.backends.local.loop import Hooks, run_local
    from nemo_jetrl.backends.local.refit import export_weights
    from nemo_jetrl.vllm_patch.settings import ENV_VAR

    before = {p.pid for p in multiprocessing.active_children()}  # other modules' engines
    runs, steps = [], []
    hooks = Hooks(on_run=runs.append, after_step=lambda step, s: steps.append((step, dict(s))))
    log_dir = tmp_path / "run"
    res = run_local(
        _cfg(recipe, log_dir, tmp_path / "cache"), progress=False, hooks=hooks, log=print
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
    assert run.engine.refits == 3  # the first load + one per step
    for step, s in steps:
        bad = {k: v for k, v in s.items() if not math.isfinite(v)}
        assert not bad, f"step {step}: non-finite metrics {bad}"
        assert s["jetrl/local/refit_refused"] == 0.0
        assert s["jetrl/local/vllm_parity_tensors"] == n_tensors + EXTRA_SCALE_TENSORS[recipe]
        if recipe == "jetrl_kv":  # the trainer's calibrated scales, set and read back
            assert s["jetrl/local/vllm_kv_layers"] == 2.0, step
        tmpe = s["train/token_mult_prob_error"]
        print(f"{recipe} step {step}: token_mult_prob_error {tmpe:.6f}")
        assert abs(tmpe - 1.0) < TMPE_BOUND, f"step {step}: token_mult_prob_error {tmpe}"
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
        assert max(abs(g - p) for g, p in zip(gen, prev, strict=True)) < 0.5
        assert gen != prev
    assert list(log_dir.rglob("events.out.tfevents.*")), "no TensorBoard event file"
    # closed at the end: engine gone, patch reverted, no engine process left
    assert run.engine.closed
    assert ENV_VAR not in os.environ
    left = [p for p in multiprocessing.active_children() if p.pid not in before]
    for p in left:  # vLLM's shutdown sends SIGTERM and may return before the process is gone
        p.join(timeout=30)
    left = [p for p in left if p.is_alive()]
    assert not left, f"engine processes still alive after the run: {left}"


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


def test_unknown_rollout_engine_names_key_and_choices(tmp_path):
    from nemo_jetrl.backends.local.config import validate_local_config

    (issue,) = validate_local_config({"rollout_engine": "sglang"})
    assert issue.path == "jetrl.local.rollout_engine"
    assert "'sglang'" in issue.message and "hf, vllm" in issue.message
