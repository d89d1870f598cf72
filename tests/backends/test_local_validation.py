"""Validation of a local run: greedy decoding under batch-invariant ops decodes each distinct
validation prompt once (`RunStep._validation_rows`) and reports exactly what decoding every
row reports."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from local_configs import tiny_cfg

import nemo_jetrl.backends.local.step as step_mod
from nemo_jetrl.backends.local.loop import LocalRun, resolve_run

# random-init weights (no warm start): their greedy answers differ from prompt to prompt
SETTINGS = ("jetrl.local.task.val_size=96", "jetrl.local.warmstart.enabled=false")


SCORE = step_mod.score


def _validate(run: LocalRun, monkeypatch) -> tuple[dict, list[int], list[tuple]]:
    """validate()'s metrics (timing left out), the batch sizes it decoded and what it scored."""
    rows, scored = [], []
    gen, score = LocalRun._generate.__get__(run), SCORE

    def spy_gen(prompts, g, *, greedy):
        rows.append(prompts.shape[0])
        return gen(prompts, g, greedy=greedy)

    def spy_score(p, text, finished, cfg):
        scored.append((p.prompt, text, bool(finished)))
        return score(p, text, finished, cfg)

    monkeypatch.setattr(run, "_generate", spy_gen)
    monkeypatch.setattr(step_mod, "score", spy_score)
    out = {k: v for k, v in run.validate().items() if not k.startswith("timing/")}
    return out, rows, scored


@pytest.mark.parametrize("recipe", ["jetrl", "fp8_rollout", "jetrl_kv"])
def test_each_distinct_prompt_is_decoded_once_with_the_same_metrics(tmp_path, monkeypatch, recipe):
    run = LocalRun(resolve_run(tiny_cfg(recipe, tmp_path, tmp_path / "cache", *SETTINGS)))
    try:
        distinct = len({p.prompt for p in run.val_problems})
        assert distinct < len(run.val_problems) == 96  # the set repeats problems
        fast, rows, scored = _validate(run, monkeypatch)
        assert rows == [distinct]
        every = (run.val_problems, list(range(len(run.val_problems))))
        monkeypatch.setattr(run, "_validation_rows", lambda: every)
        full, rows_full, scored_full = _validate(run, monkeypatch)
        assert rows_full == [96]
        assert scored == scored_full and fast == full
        assert len({t for _, t, _ in scored}) > 3  # the answers differ: the mapping is tested
    finally:
        run.close()


@pytest.mark.parametrize(
    ("recipe", "extra"),
    [
        ("bf16", ()),  # BF16 decoder GEMMs: rounding may depend on the row count
        ("jetrl", ("jetrl.local.batch_invariant=false",)),  # HF's ops
        ("jetrl", ("jetrl.local.val_greedy=false",)),  # sampled: repeats are separate draws
        (  # a BF16 first layer: its GEMM (bf16_gemm.Bf16CpuLinear) is batch-variant
            "jetrl",
            (
                "++jetrl.train_num_first_layers_in_bf16=1",
                "++policy.generation.vllm_cfg.num_first_layers_in_bf16=1",
            ),
        ),
    ],
)
def test_batch_variant_or_sampled_validation_decodes_every_row(
    tmp_path, monkeypatch, recipe, extra
):
    run = LocalRun(resolve_run(tiny_cfg(recipe, tmp_path, tmp_path / "cache", *SETTINGS, *extra)))
    try:
        _, rows, _ = _validate(run, monkeypatch)
        assert rows == [96]
    finally:
        run.close()


def test_validation_after_a_step_measures_the_updated_policy_with_one_refit(tmp_path, monkeypatch):
    """The rollout is refit at the start of each step; validation comes after the step's update,
    so it refits first (as NeMo-RL does with a stale generation), and the next step uses that
    refit. Before: validation measured the policy of one update earlier (step 1's accuracy was
    step 0's)."""
    from nemo_jetrl.backends.local.step import Hooks

    lr = "policy.optimizer.kwargs.lr=0.01"  # large: one update changes the greedy answers
    run = LocalRun(resolve_run(tiny_cfg("jetrl", tmp_path, tmp_path / "cache", *SETTINGS, lr)))
    try:
        refits: list[int] = []
        real = run.do_refit
        monkeypatch.setattr(
            run, "do_refit", lambda h, **kw: refits.append(run.step) or real(h, **kw)
        )
        _, _, at_start = _validate(run, monkeypatch)
        assert refits == []  # nothing updated yet: the rollout is the trainer's policy
        s1, _ = run.train_step(Hooks())
        assert refits == [0] and s1["jetrl/local/refit_refused"] == 0.0
        _, _, after_one = _validate(run, monkeypatch)
        assert refits == [0, 1]
        assert after_one != at_start  # the updated policy answers otherwise
        assert _validate(run, monkeypatch)[2] == after_one and refits == [0, 1]  # no update
        s2, _ = run.train_step(Hooks())
        assert refits == [0, 1] and s2["jetrl/local/refit_refused"] == 0.0  # validation's refit
        run.train_step(Hooks())
        assert refits == [0, 1, 2] and run.step == 3
    finally:
        run.close()
