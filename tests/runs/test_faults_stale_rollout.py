"""A local run checkpointed while refits are refused resumes on the rollout's last good weights.

After a refused refit the rollout keeps the weights of its last accepted refit. The checkpoint
written then holds those weights too, so a run resumed from it rolls out from them as the
uninterrupted run does (before: from the warm start's, seen as step 6's tmpe 1.33 uninterrupted,
1.92 resumed). A checkpoint written while the rollout holds the trainer's weights holds none.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import fault_warm_cache
from fault_warm_cache import RECIPE
from local_configs import tiny_cfg

from nemo_jetrl.backends.local import checkpoint as ckpt
from nemo_jetrl.backends.local.loop import Hooks, resolve_run, run_local
from nemo_jetrl.backends.local.resume import ROLLOUT_KEY

cache_dir = fault_warm_cache.cache_dir  # the module-scoped warm-start cache (a fixture)
FIRST_REFUSED = 3  # every refit from the one for step 3 on carries a NaN


def _refuse_late(step: int, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Step 2's refit loads weights 2% larger than the trainer's (accepted: the rollout's last
    good weights then differ from the warm start's even where a tiny run's update is zero);
    every later one carries a NaN (refused)."""
    weights = dict(weights)
    if step == FIRST_REFUSED - 1:
        weights = {k: v * 1.02 if v.is_floating_point() else v for k, v in weights.items()}
    elif step >= FIRST_REFUSED:
        k = next(iter(weights))
        weights[k] = torch.full_like(weights[k], float("nan"))
    return weights


def _numbers(h: dict) -> dict:
    return {k: v for k, v in h.items() if not k.startswith(("timing/", "jetrl/local/cpu_time/"))}


def test_a_resume_while_refits_are_refused_rolls_out_from_the_last_good_weights(
    tmp_path, cache_dir
):
    every = ("grpo.max_num_steps=4", "grpo.val_period=0", "checkpointing.save_period=1")
    hooks = Hooks(before_refit=_refuse_late)
    quiet = dict(progress=False, log=lambda _m: None, hooks=hooks)
    full = run_local(resolve_run(tiny_cfg(RECIPE, tmp_path / "full", cache_dir, *every)), **quiet)
    assert [h["jetrl/local/refit_refused"] for h in full.history] == [0.0, 0.0, 1.0, 1.0]

    part = tmp_path / "part"
    stop = f"grpo.max_num_steps={FIRST_REFUSED}"
    run_local(resolve_run(tiny_cfg(RECIPE, part, cache_dir, *every, stop)), **quiet)
    states = {d.name: ckpt.load_checkpoint(d)[1] for d in sorted((part / "checkpoints").iterdir())}
    assert states["step_2"][ROLLOUT_KEY] is None  # the rollout held the trainer's weights
    kept = states[f"step_{FIRST_REFUSED}"][ROLLOUT_KEY]
    assert kept and all(torch.isfinite(v.float()).all() for v in kept.values())

    msgs: list[str] = []
    res = run_local(resolve_run(tiny_cfg(RECIPE, part, cache_dir, *every)), resume=True,
                    **{**quiet, "log": msgs.append})  # fmt: skip
    assert res.first_step == FIRST_REFUSED and res.history[0]["step"] == FIRST_REFUSED + 1
    resumed, uninterrupted = _numbers(res.history[0]), _numbers(full.history[-1])
    assert resumed["jetrl/local/refit_refused"] == 1.0
    assert resumed == uninterrupted  # tmpe, gen_kl, rewards... bit for bit
    name = f"train_data_step{FIRST_REFUSED + 1}.jsonl"
    assert (part / name).read_bytes() == (tmp_path / "full" / name).read_bytes()
    assert any("last accepted refit" in m for m in msgs), msgs


def test_the_kept_weights_are_what_the_rollout_holds_after_the_trainer_moves(tmp_path, cache_dir):
    """The trainer's optimizer step writes its weights in place: what the last accepted refit
    loaded is kept as a copy (the rollout's plain tensors, here the embedding, stay equal to
    it), and only where checkpoints are saved."""
    from nemo_jetrl.backends.local.setup import LocalRun

    run = LocalRun(resolve_run(tiny_cfg(RECIPE, tmp_path / "run", cache_dir)))
    try:
        assert run.run.checkpoint_enabled and run.do_refit(Hooks()) == (True, None)
        with torch.no_grad():
            for p in run.trainer.model.parameters():
                p.add_(1.0)  # as an update does, in place
        name = "model.embed_tokens.weight"
        held = dict(run.rollout_model.named_parameters())[name]
        assert torch.equal(run.rollout_source[name].to(held.dtype), held)
        assert not torch.equal(run.trainer.model.state_dict()[name].to(held.dtype), held)
    finally:
        run.close()
    off = LocalRun(
        resolve_run(tiny_cfg(RECIPE, tmp_path / "off", cache_dir, "checkpointing.enabled=false"))
    )
    try:
        assert off.do_refit(Hooks()) == (True, None) and off.rollout_source is None
    finally:
        off.close()
