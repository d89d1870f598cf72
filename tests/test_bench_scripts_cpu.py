"""CPU sanity of benchmarks/gpu as a whole: every script is listed and documented, imports,
parses its defaults and refuses CPU clearly; _common's timer's defaults; bench_vllm_generation's
engine setups; and the two scripts that run end to end on CPU: bench_refit_calibration on a tiny
model, bench_local_grpo with every recipe (and its verdict and error paths). No timing claims.
The dense FP8 scripts' checks: test_bench_fp8_dense_cpu.py; the MoE layer's:
test_bench_moe_layer_cpu.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from gpu_bench_fixtures import BENCH_DIR, bench_fixture  # noqa: F401  (bench_fixture: `bench`)

SCRIPTS = (
    "bench_quantizer_bandwidth",
    "bench_fp8_linear",
    "bench_vllm_generation",
    "bench_refit_calibration",
    "bench_moe_layer",
    "bench_serving_kernel",
    "bench_local_grpo",
    "bench_invariant_ops",
)


def test_every_script_is_listed_and_documented():
    found = sorted(p.stem for p in BENCH_DIR.glob("bench_*.py"))
    assert found == sorted(SCRIPTS)
    readme = (BENCH_DIR / "README.md").read_text()
    for name in SCRIPTS:
        assert f"{name}.py" in readme, f"README.md does not describe {name}.py"


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_parses_and_refuses_cpu(name, bench, capsys, monkeypatch):
    module = bench(name)
    assert module.__doc__ and callable(module.main)
    args = module.build_parser().parse_args([])
    assert vars(args)
    if torch.cuda.is_available():
        return
    with pytest.raises(SystemExit) as exc:
        module.main([])
    assert exc.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_timing_helper_flushes_l2_and_can_replay_a_graph(bench):
    common = bench("_common")
    import inspect

    params = inspect.signature(common.bench_ms).parameters
    assert params["flush_l2"].default is True and params["graph"].default is False
    assert common._L2_FLUSH_BYTES >= 2 * 60 * 2**20  # twice an H200's L2
    assert common.l2_bytes("cpu") is None  # a CPU has no L2 size to grade a layer timing on


def test_environ_sets_and_unsets_for_the_block_and_restores_after_a_raise(bench, monkeypatch):
    """The one helper the scripts and the census set knobs with (a layer reads them when it
    plans): a value set, None unset, each back to its value or to unset, also on an error."""
    common = bench("_common")
    monkeypatch.setenv("JETRL_T_KEEP", "old")
    monkeypatch.delenv("JETRL_T_NEW", raising=False)
    with pytest.raises(RuntimeError), common.environ({"JETRL_T_KEEP": None, "JETRL_T_NEW": "1"}):
        assert "JETRL_T_KEEP" not in os.environ and os.environ["JETRL_T_NEW"] == "1"
        raise RuntimeError("inside")
    assert os.environ["JETRL_T_KEEP"] == "old" and "JETRL_T_NEW" not in os.environ


def test_vllm_setups_build_engine_kwargs(bench):
    module = bench("bench_vllm_generation")
    from nemo_jetrl.vllm_patch import build_engine_kwargs

    expected = {
        "bf16": (False, "auto"),
        "bf16_kv": (False, "fp8"),
        "jetrl": (True, "auto"),
        "jetrl_kv": (True, "fp8"),
    }
    for setup in module.SETUPS:
        ek = build_engine_kwargs(module.recipe_for(setup), {"max_num_seqs": 128}, num_layers=36)
        assert (ek.settings.fp8_weights, ek.settings.kv_cache_dtype) == expected[setup], setup
        assert ek.kwargs["max_num_seqs"] == 128


def test_refit_calibration_runs_on_a_tiny_model_on_cpu(bench, tmp_path, capsys):
    module = bench("bench_refit_calibration")
    cfg = {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 4096,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["--device", "cpu", "--model", str(tmp_path), "--train-seqs", "4", "--prompt-len", "8",
            "--seq-len", "24", "--measure-micro-batches", "1", "--rollout-seconds", "10"]  # fmt: skip
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    assert "14 FP8 linears" in out  # 2 layers x 7 linears, all 128-aligned
    assert "refit_quant" in out and "kv_calib" in out
    for row in ("refit_snapshot", "refit_load_parity", "refit_total"):
        assert row in out
    assert "rollback snapshot" in out


def test_local_grpo_runs_every_recipe_on_cpu(bench, tmp_path, capsys):
    """``--device cpu --steps 1 --tiny``: the same code path as on cuda, every recipe; jetrl and
    jetrl_kv exactly on-policy (MET), fp8_rollout off-policy (mismatch > 0)."""
    module = bench("bench_local_grpo")
    out = tmp_path / "rows.json"
    argv = ["--device", "cpu", "--steps", "1", "--tiny", "--models", "qwen3-0.6b-shaped",
            "--json", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    text = capsys.readouterr().out
    rows = {r["recipe"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == sorted(module.RECIPES)
    # jetrl in both scale modes and on the split-K GEMM (CUDA operands only: here the reference)
    for r in ("jetrl", "jetrl@fp32", "jetrl_kv", "jetrl@splitk"):
        assert rows[r]["exactly_on_policy"] == "MET" and rows[r]["tmpe_max"] == 1.0
        assert rows[r]["gen_kl_max"] == 0.0
    assert rows["fp8_rollout"]["mismatch"] > 0 and rows["fp8_rollout"]["exactly_on_policy"] == "-"
    for name, row in rows.items():
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["timed_steps"] == 1
        # the step's phases under NeMo-RL's names, within the step's wall time, and its CPU time
        phases = row["phases_s"]
        assert {"generation", "policy_training", "prepare_for_generation"} <= set(phases), name
        assert 0 < sum(phases.values()) <= row["step_s"] and row["cpu_s"] > 0, (name, phases)
        if name == "jetrl@fast":  # batch_invariant=false: none of the invariant ops ran
            assert row["invariant_ops_share"] == 0 and row["exactly_on_policy"] == "-"
        else:
            assert 0 < row["invariant_ops_share"] < 1  # every other recipe runs them
    assert text.count("exactly on-policy: MET") == 4
    assert text.count("phases (s): ") == len(module.RECIPES) and "host CPU " in text
    assert "cost of exactness (qwen3-0.6b-shaped): jetrl step " in text
    assert "not resolved (1 timed steps" in text  # --steps 1: one step cannot resolve a cost
    with pytest.raises(ValueError, match="the suffixes are @fp32, @splitk, @fast"):
        module.run_recipe("jetrl@e8m0", None, module.build_parser().parse_args([]), tmp_path)


def test_cost_of_exactness_is_resolved_only_by_timed_steps_that_do_not_overlap(bench):
    """Run 8 printed a 1.16x cost from one timed step a recipe, where two exact recipes' single
    steps differed by 1.6x: the line now says whether 3+ timed steps a recipe separate it."""
    module = bench("bench_local_grpo")

    def row(recipe, lo, hi, timed=3):  # type: ignore[no-untyped-def]
        mid = (lo + hi) / 2
        return {"model": "m", "recipe": recipe, "step_s": mid, "step_range_s": [lo, hi],
                "tokens_per_s": 100 / mid, "timed_steps": timed}  # fmt: skip

    (apart,) = module.exactness_cost([row("jetrl", 1.2, 1.3), row("jetrl@fast", 1.0, 1.1)])
    assert apart.endswith("timed steps 1.200-1.300 s vs 1.000-1.100 s: resolved"), apart
    assert "1.19x the step time" in apart  # 1.25 / 1.05
    (overlap,) = module.exactness_cost([row("jetrl", 1.05, 1.3), row("jetrl@fast", 1.0, 1.1)])
    assert overlap.endswith("not resolved (3 timed steps, ranges overlap)"), overlap
    one = module.exactness_cost([row("jetrl", 3.67, 3.67, 1), row("jetrl@fast", 3.1, 3.1, 5)])
    assert one[0].endswith("not resolved (1 timed steps, ranges apart)"), one
    assert module.exactness_cost([row("jetrl", 1.0, 1.1)]) == []  # no jetrl@fast: no line


def test_local_grpo_reports_a_failed_or_off_policy_run_and_runs_the_rest(
    bench, tmp_path, monkeypatch
):
    """The verdict and error paths (runs stubbed: the real ones are the test above): a run that
    raises is a row with its error, a jetrl that is not exactly 1 is NOT MET, exit 1 either way,
    and the JSON holds every row."""
    module = bench("bench_local_grpo")
    done = []

    def fake(recipe, model, args, work):
        done.append(recipe)
        if recipe == "bf16":
            raise RuntimeError("CUDA out of memory (planted)")
        tmpe = 1.0 + 1e-6 if recipe == "jetrl" else 1.0
        return {"recipe": recipe, "tmpe_max": tmpe, "gen_kl_max": 0.0, "mismatch": tmpe - 1,
                "exact_every_step": tmpe == 1.0, "step_s": 1.0, "tokens_per_s": 1.0,
                "invariant_ops_share": 0.5, "steps": 1, "phases_s": {"generation": 0.5},
                "cpu_s": 0.9}  # fmt: skip

    monkeypatch.setattr(module, "run_recipe", fake)
    out = tmp_path / "rows.json"
    argv = ["--device", "cpu", "--models", "demo", "--recipes", "bf16,jetrl,jetrl_kv",
            "--json", str(out)]  # fmt: skip
    assert module.main(argv) == 1
    assert done == ["bf16", "jetrl", "jetrl_kv"]
    rows = {r["recipe"]: r for r in json.loads(out.read_text())["rows"]}
    assert "planted" in rows["bf16"]["error"]
    assert rows["jetrl"]["exactly_on_policy"] == "NOT MET"
    assert rows["jetrl_kv"]["exactly_on_policy"] == "MET"
