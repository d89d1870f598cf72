"""The benchmark scripts' verdicts (benchmarks/gpu/, imported by name through the tests' `bench`
fixture): what they call MET, NOT MET or resolved from the rows a GPU run measures."""

from __future__ import annotations

from mutation_check import Mutant

T_DENSE = "tests/test_bench_fp8_dense_cpu.py::"
T_SCRIPTS = "tests/test_bench_scripts_cpu.py::"
T_TARGETS = "tests/fp8/test_fp8_linear_bench_targets.py::"
MUTANTS = [
    Mutant(
        "cost of exactness: overlapping timed-step ranges called apart",
        "benchmarks/gpu/bench_local_grpo.py",
        "apart = e_lo > f_hi or e_hi < f_lo",
        "apart = e_lo >= f_lo or e_hi < f_lo",
        (T_SCRIPTS + "test_cost_of_exactness_is_resolved_only_by_timed_steps_that_do_not_overlap",),
    ),
    Mutant(
        "cost of exactness resolved from one timed step a recipe",
        "benchmarks/gpu/bench_local_grpo.py",
        "MIN_TIMED_STEPS = 3 ",
        "MIN_TIMED_STEPS = 1 ",
        (T_SCRIPTS + "test_cost_of_exactness_is_resolved_only_by_timed_steps_that_do_not_overlap",),
    ),
    Mutant(
        "an exact recipe off on some step still called exactly on-policy",
        "benchmarks/gpu/bench_local_grpo.py",
        'return "MET" if row["exact_every_step"] else "NOT MET"',
        'return "MET"',
        (T_SCRIPTS + "test_local_grpo_reports_a_failed_or_off_policy_run_and_runs_the_rest",),
    ),
    Mutant(
        "two_pass/fused inverted (the fused kernel's time over the two passes')",
        "benchmarks/gpu/_fp8_linear_layers.py",
        'return bench(modes["two_pass"]) / bench(modes["fused"])',
        'return bench(modes["fused"]) / bench(modes["two_pass"])',
        (T_DENSE + "test_fp8_linear_times_both_rowcol_modes",),
    ),
    Mutant(
        "the rowcol target graded on the fused kernel whatever mode the training linear runs",
        "benchmarks/gpu/bench_quantizer_bandwidth.py",
        't_ms = two_ms if mode == "two_pass" else fused_ms',
        "t_ms = fused_ms",
        (T_DENSE + "test_the_rowcol_pair_is_graded_on_the_training_linears_mode",),
    ),
    Mutant(
        "the host target met at host time equal to the GPU's",
        "benchmarks/gpu/bench_fp8_linear.py",
        'lambda r: r["host_ms"] < r["gpu_ms"],',
        'lambda r: r["host_ms"] <= r["gpu_ms"],',
        (T_TARGETS + "test_each_target_names_the_rows_short_of_it",),
    ),
    Mutant(
        "the linear targets judged on whatever rows ran (a partial run MET)",
        "benchmarks/gpu/bench_fp8_linear.py",
        "if not want <= got:",
        "if not got:",
        (T_TARGETS + "test_partial_runs_are_not_measured",),
    ),
    Mutant(
        "the layer timed after an L2 flush (its write-back cost, which no decode step pays)",
        "benchmarks/gpu/bench_serving_kernel.py",
        "graph=True, flush_l2=False)",
        "graph=True, flush_l2=True)",
        (
            T_DENSE
            + "test_serving_kernel_times_the_linears_as_one_layer_where_their_weights_are_cold",
        ),
    ),
    Mutant(
        "the layer graded where its weights may stay in L2",
        "benchmarks/gpu/bench_serving_kernel.py",
        "return l2 is not None and weight_bytes >= LAYER_COLD_L2 * l2",
        "return l2 is None or weight_bytes >= l2",
        (
            T_DENSE
            + "test_serving_kernel_times_the_linears_as_one_layer_where_their_weights_are_cold",
        ),
    ),
]
