"""A local run on the vLLM engine checkpointed while refits are refused resumes with the engine on
the rollout's last good weights (`RunCheckpointing._restore_rollout` through the engine's own
guarded refit), as the uninterrupted run rolls out: step 4's numbers equal. The HF rollout's
case, and the planted refits: tests/runs/test_faults_stale_rollout.py."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import fault_warm_cache
from local_configs import tiny_cfg
from test_faults_stale_rollout import FIRST_REFUSED, _numbers, _refuse_late

from nemo_jetrl.backends.local.loop import Hooks, resolve_run, run_local

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.vllm_versions(
        "0.32", why="the engine's guarded refit and rollback run on 0.20 in test_vllm_engine"
    ),
]
cache_dir = fault_warm_cache.cache_dir


def test_a_stale_resume_on_the_vllm_engine_rolls_out_from_the_last_good_weights(
    tmp_path, cache_dir
):
    every = ("jetrl.local.rollout_engine=vllm", "grpo.max_num_steps=4", "grpo.val_period=0",
             "checkpointing.save_period=1")  # fmt: skip
    quiet = dict(progress=False, log=lambda _m: None, hooks=Hooks(before_refit=_refuse_late))
    full = run_local(resolve_run(tiny_cfg("jetrl", tmp_path / "full", cache_dir, *every)), **quiet)
    part = tmp_path / "part"
    stop = f"grpo.max_num_steps={FIRST_REFUSED}"
    run_local(resolve_run(tiny_cfg("jetrl", part, cache_dir, *every, stop)), **quiet)
    msgs: list[str] = []
    res = run_local(resolve_run(tiny_cfg("jetrl", part, cache_dir, *every)), resume=True,
                    **{**quiet, "log": msgs.append})  # fmt: skip
    resumed, uninterrupted = _numbers(res.history[0]), _numbers(full.history[-1])
    assert resumed["jetrl/local/refit_refused"] == 1.0
    assert resumed == uninterrupted
    assert any("last accepted refit" in m for m in msgs), msgs
