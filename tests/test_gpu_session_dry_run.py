"""The one-call GPU session's plan on CPU (docs/gpu.md): benchmarks/gpu/device_session.sh's dry
run, its steps within the 540 s budget, one issue's part per call and the limits that exceed the
budget; scripts/gpu_check.sh's module list and its arguments (pytest-timeout's per-test limit,
the xdist workers) under a fake interpreter. Nothing runs but the scripts' planning.
"""

from __future__ import annotations

import re

import pytest
from gpu_session_helpers import GPU_CHECK, REPO, SESSION, gpu_test_modules, sh

BUDGET_S = 540


def dry_run_steps(out: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"^  (\w+) +(\d+) s", out, re.M)}


# -- the dry run and its budget ---------------------------------------------------------------


def test_dry_run_lists_the_steps_in_order_within_540_s():
    p = sh("bash", SESSION, "--dry-run")
    assert p.returncode == 0, p.stdout + p.stderr
    steps = dry_run_steps(p.stdout)
    assert sum(steps.values()) <= BUDGET_S
    assert f"sum {sum(steps.values())} s <= {BUDGET_S} s" in p.stdout
    names = list(steps)
    # issue 47's on-policy run first, then issue 48's benchmarks, the pack last
    assert names[:3] == ["preflight", "invariant_tests", "bench_local_grpo"], names
    for bench in ("bench_serving_fp32", "bench_serving_pow2", "bench_moe_layer",
                  "bench_fp8_linear", "bench_quantizer", "bench_moe_tiles"):  # fmt: skip
        assert bench in names and names.index(bench) > names.index("bench_local_grpo")
    # the two sweeps that pick defaults (issue 48 points 3, 4), the MoE one after its figures
    assert "bench_quantizer_bandwidth.py --iters 20 --sweep-tiles" in p.stdout
    assert names.index("bench_moe_tiles") > names.index("bench_moe_layer")
    assert "--tokens 2048 8192 --iters 10 --tiles sweep" in p.stdout
    assert names[-1] == "pack"
    # issue 47: the exact recipes first, then what the tokens/s table compares them with (the
    # off-policy baseline, bf16, jetrl without the invariant ops), then jetrl's other modes
    recipes = "jetrl,jetrl_kv,fp8_rollout,bf16,jetrl@fast,jetrl@fp32,jetrl@splitk"
    assert "--steps 5" in p.stdout and f"--recipes {recipes} " in p.stdout
    # the three test steps split gpu_check.sh's list between them, each module once: the
    # invariant kernels' and the rollout's device sampling (issue 47), the changed kernels'
    # (split-K GEMM, the quantizers' two modules, the refit under a captured graph, the rows
    # padded for cuBLASLt, the graphed training linear; before the serving benchmarks), the rest
    counts = [int(n) for n in re.findall(r"JETRL_GPU_TESTS=\((\d+) modules", p.stdout)]
    inv = [m for m in gpu_test_modules() if m.startswith("tests/invariant/")]
    inv.append("tests/backends/test_local_sampling.py")
    assert counts == [len(inv), 6, len(gpu_test_modules()) - len(inv) - 6] and len(inv) >= 3
    assert names.index("kernel_tests") < names.index("bench_serving_fp32")
    assert "jetrl@splitk" in p.stdout and p.stdout.count("--backends auto,triton_splitk") == 2


def test_a_call_can_run_one_issues_part_within_what_the_loan_has_left():
    """JETRL_PART=47: the on-policy steps, with more than the time both models' fourteen recipes
    took on the H200 at 3 steps (271 s, run 8; 5 steps now) and more than the 75 s in which the invariant tests did not finish
    cold (run 8); JETRL_PART=48 the speed steps, cut to fit a second call's JETRL_BUDGET_S (run
    8's had 420 s); an explicit limit still wins; bad values exit 2 before anything runs."""
    on_policy = sh("bash", SESSION, "--dry-run", env={"JETRL_PART": "47"})
    steps = dry_run_steps(on_policy.stdout)
    assert on_policy.returncode == 0 and sum(steps.values()) <= BUDGET_S, on_policy.stdout
    assert {n for n, s in steps.items() if s} == {
        "preflight",
        "invariant_tests",
        "bench_local_grpo",
        "bench_invariant_ops",
        "pack",
    }
    assert steps["bench_local_grpo"] >= 271 and steps["invariant_tests"] > 75
    speed = sh("bash", SESSION, "--dry-run", env={"JETRL_PART": "48", "JETRL_BUDGET_S": "300"})
    steps = dry_run_steps(speed.stdout)
    assert speed.returncode == 0 and sum(steps.values()) <= 300, speed.stdout
    assert "budget 300 s" in speed.stdout and "timeout_s 350" in speed.stdout
    assert not steps["invariant_tests"] and not steps["bench_local_grpo"]
    assert all(steps[b] for b in ("kernel_tests", "bench_serving_fp32", "bench_serving_sweep",
                                  "bench_moe_layer", "bench_fp8_linear", "bench_quantizer",
                                  "profile_kernels"))  # fmt: skip
    # run 8: both profiles timed out at 10 s
    assert steps["profile_host"] > 10 and steps["profile_kernels"] > 10
    # measured in run 7 with nothing of theirs changed since: not in the second call's 300 s
    assert not steps["bench_serving_pow2"] and not steps["bench_moe_tiles"]
    forced = sh("bash", SESSION, "--dry-run", env={"JETRL_PART": "48", "JETRL_LOCAL_GRPO_S": "60"})
    assert dry_run_steps(forced.stdout)["bench_local_grpo"] == 60
    for env, knob in (({"JETRL_PART": "47,48"}, "JETRL_PART=47,48: use all, 47"),
                      ({"JETRL_BUDGET_S": "600"}, "JETRL_BUDGET_S=600: use whole seconds, 16-540")):  # fmt: skip
        bad = sh("bash", SESSION, "--dry-run", env=env)
        assert bad.returncode == 2 and knob in bad.stderr and not bad.stdout, bad.stderr


def test_dry_run_fails_when_the_limits_exceed_the_budget():
    p = sh("bash", SESSION, "--dry-run", env={"JETRL_LOCAL_GRPO_S": "400"})
    assert p.returncode == 1, p.stdout
    total = sum(dry_run_steps(p.stdout).values())
    assert total > BUDGET_S and f"sum {total} s > {BUDGET_S} s" in p.stdout


def test_gpu_check_lists_existing_modules():
    modules = gpu_test_modules()
    assert len(modules) == len(set(modules)) >= 20
    assert all((REPO / m).is_file() for m in modules), modules


# -- scripts/gpu_check.sh without pytest-timeout ------------------------------------------------

FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for a Python with a GPU and pytest, with or without pytest-timeout.
if [[ "$1" == - ]]; then cat >/dev/null; echo "gpu_check: FAKE GPU"; exit 0; fi
if [[ "$1" == -c && "$2" == "import pytest_timeout" ]]; then exit "$FAKE_NO_TIMEOUT"; fi
if [[ "$1" == -c && "$2" == "import xdist" ]]; then exit "${FAKE_NO_XDIST:-1}"; fi
printf 'ARGS:'; printf ' %s' "$@"; echo
"""


@pytest.mark.parametrize("plugin", [True, False])
def test_gpu_check_passes_timeout_only_where_pytest_timeout_is(tmp_path, plugin):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = {"PYTHON": str(fake), "FAKE_NO_TIMEOUT": "0" if plugin else "1",
           "JETRL_TEST_TIMEOUT": "45", "JETRL_GPU_TESTS": "tests/a.py tests/b.py"}  # fmt: skip
    p = sh("bash", GPU_CHECK, "-x", "--timeout", "90", "--timeout=30", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    args = next(line for line in p.stdout.splitlines() if line.startswith("ARGS:")).split()[1:]
    assert args[:2] == ["-m", "pytest"] and "tests/a.py" in args and "tests/b.py" in args
    assert not any(a.startswith("tests/fp8") for a in args)  # JETRL_GPU_TESTS replaced the list
    if plugin:
        assert args.count("--timeout") == 2 and "45" in args and "--timeout=30" in args
    else:
        assert not any(a.startswith("--timeout") for a in args), args
        assert "-x" in args
        assert "pytest-timeout is not installed: no per-test limit" in p.stdout


@pytest.mark.parametrize(
    "workers, xdist, modules, want",
    [("4", True, 6, ["-n", "4", "--dist", "loadfile"]), ("8", True, 3, ["-n", "3", "--dist", "loadfile"]),
     ("4", False, 6, []), ("0", True, 6, []), ("1", True, 6, []), ("4", True, 1, [])],
    ids=["4-workers", "at-most-one-a-module", "no-xdist", "0", "1", "one-module"],
)  # fmt: skip
def test_gpu_check_spreads_the_modules_over_xdist_workers(tmp_path, workers, xdist, modules, want):
    """JETRL_GPU_TEST_WORKERS: the GPU modules in that many pytest-xdist processes, each module
    in one (--dist loadfile), never more workers than modules; one process where xdist is
    missing (said), for 0 and 1, and for one module."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    listed = " ".join(f"tests/m{i}.py" for i in range(modules))
    env = {"PYTHON": str(fake), "FAKE_NO_TIMEOUT": "1", "FAKE_NO_XDIST": "0" if xdist else "1",
           "JETRL_GPU_TEST_WORKERS": workers, "JETRL_GPU_TESTS": listed}  # fmt: skip
    p = sh("bash", GPU_CHECK, "-x", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    args = next(line for line in p.stdout.splitlines() if line.startswith("ARGS:")).split()[1:]
    assert args[:2] == ["-m", "pytest"] and "-x" in args
    got = args[args.index("-n") : args.index("-n") + 4] if "-n" in args else []
    assert got == want, args
    said = "pytest-xdist is not installed: one process" in p.stdout
    assert said == (not xdist and int(workers) > 1 and modules > 1), p.stdout


@pytest.mark.parametrize("workers", ["two", "-1", "2.5"])
def test_gpu_check_refuses_a_worker_count_that_is_not_a_whole_number(tmp_path, workers):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    p = sh("bash", GPU_CHECK, env={"PYTHON": str(fake), "JETRL_GPU_TEST_WORKERS": workers})
    assert p.returncode == 2 and "ARGS:" not in p.stdout, p.stdout
    assert f"JETRL_GPU_TEST_WORKERS={workers}: use a whole number" in p.stderr
