"""The one-call GPU session on CPU (docs/gpu.md): benchmarks/gpu/device_session.sh's dry run and
budget, its report, its preflight, scripts/gpu_check.sh's handling of a missing pytest-timeout,
and (slow) the wheel set alone collecting the GPU tests in a stand-in of the bare GPU image, and
the whole session script run on CPU.

The stand-in of the image: `python -S` (no site-packages) with PYTHONPATH = the repository, an
empty `--target` holding only the wheel set, and a folder of links to what the image itself has
that the steps use (torch, triton, numpy, pytest, tensorboard and what they require; KINDS.md of
the device tool lists each). The image runs Python 3.12 and this machine 3.11, so the stand-in
installs the same pins fetched for 3.11 (`JETRL_GPU_WHEELS_PY=3.11`); the cp312 set that travels
is installed with the device's tags into its own empty target.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SESSION = REPO / "benchmarks" / "gpu" / "device_session.sh"
GPU_CHECK = REPO / "scripts" / "gpu_check.sh"
WHEELS_TXT = REPO / "scripts" / "gpu_wheels.txt"
BUDGET_S = 540
# What the bare image has that the steps use (KINDS.md's package list): the stand-in takes these
# and their requirements from this machine's environment, and nothing else.
IMAGE_ROOTS = ("torch", "triton", "numpy", "pytest", "tensorboard")
BENCHES = (
    "bench_local_grpo", "bench_invariant_ops", "bench_serving_kernel", "bench_moe_layer",
    "bench_fp8_linear", "profile_host", "profile_kernels", "bench_quantizer_bandwidth",
)  # fmt: skip
DEVICE_TAGS = [
    *("--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"),
    *(f"--platform={p}_x86_64" for p in ("manylinux_2_28", "manylinux_2_17", "manylinux2014")),
]


def sh(*cmd, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def gpu_test_modules() -> list[str]:
    p = sh("bash", GPU_CHECK, "--list")
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


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
    assert "--steps 3" in p.stdout and f"--recipes {recipes} " in p.stdout
    # the three test steps split gpu_check.sh's list between them, each module once: the
    # invariant kernels', the changed kernels' (split-K GEMM, quantizers; before the serving
    # benchmarks), the rest
    counts = [int(n) for n in re.findall(r"JETRL_GPU_TESTS=\((\d+) modules", p.stdout)]
    inv = [m for m in gpu_test_modules() if m.startswith("tests/invariant/")]
    assert counts == [len(inv), 2, len(gpu_test_modules()) - len(inv) - 2] and len(inv) >= 3
    assert names.index("kernel_tests") < names.index("bench_serving_fp32")
    assert "jetrl@splitk" in p.stdout and p.stdout.count("--backends auto,triton_splitk") == 2


def test_a_call_can_run_one_issues_part_within_what_the_loan_has_left():
    """JETRL_PART=47: the on-policy steps, with the ~0.6B model's seven recipes' time (~50 s
    each on the H200, run 7); JETRL_PART=48 the speed steps, cut to fit a second call's
    JETRL_BUDGET_S; an explicit limit still wins; bad values exit 2 before anything runs."""
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
    assert steps["bench_local_grpo"] >= 7 * 50
    speed = sh("bash", SESSION, "--dry-run", env={"JETRL_PART": "48", "JETRL_BUDGET_S": "250"})
    steps = dry_run_steps(speed.stdout)
    assert speed.returncode == 0 and sum(steps.values()) <= 250, speed.stdout
    assert "budget 250 s" in speed.stdout and "timeout_s 300" in speed.stdout
    assert not steps["invariant_tests"] and not steps["bench_local_grpo"]
    assert all(steps[b] for b in ("kernel_tests", "bench_serving_fp32", "bench_serving_sweep",
                                  "bench_moe_layer", "bench_fp8_linear", "bench_quantizer",
                                  "profile_kernels"))  # fmt: skip
    # measured in run 7 with nothing of theirs changed since: not in the second call's 250 s
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


# -- the report ---------------------------------------------------------------------------------


def test_report_ends_with_every_verdict_line_of_every_log(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "logs").mkdir(parents=True)
    (work / "json").mkdir()
    (work / "steps.tsv").write_text(
        "preflight\t30\t0\t9\t\nbench_moe_layer\t35\t1\t20\t\nbench_quantizer\t35\t124\t38\tTIMEOUT\n"
        "fp8_tests\t110\t\t0\tnot run: no time left\n"
    )
    (work / "source.txt").write_text("commit abc123 (2026-11-29), tree clean\n")
    (work / "header.txt").write_text("gpu: NVIDIA H200, 580.159.04, 143771 MiB\nstamp: x\n")
    (work / "logs" / "bench_moe_layer.log").write_text(
        "rows\n# target (issue 35): ... at 2048: NOT MET (2048 0.79x)\nIMMETIATE is no verdict\n"
    )
    (work / "logs" / "bench_quantizer.log").write_text(
        "q 128x128: 88%: MET\nq 128x1: NOT MEASURED\n"
    )
    (work / "json" / "bench_moe_layer.json").write_text('{"rows": [1, 2]}')
    p = sh(sys.executable, REPO / "benchmarks" / "gpu" / "session.py", "report", work, out)
    assert p.returncode == 0, p.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[1] == "source: commit abc123 (2026-11-29), tree clean"
    assert "gpu: NVIDIA H200, 580.159.04, 143771 MiB" in summary
    assert "== bench_quantizer rc=124 in 38s (limit 35s) TIMEOUT" in summary
    assert "== fp8_tests not run: no time left (limit 110s)" in summary
    assert summary[-4:] == [
        "MET / NOT MET (3 lines from the steps' logs):",
        "bench_moe_layer: # target (issue 35): ... at 2048: NOT MET (2048 0.79x)",
        "bench_quantizer: q 128x128: 88%: MET",
        "bench_quantizer: q 128x1: NOT MEASURED",
    ]
    record = json.loads((out / "results.json").read_text())
    assert [s["rc"] for s in record["steps"]] == [0, 1, 124, None]
    assert record["bench"] == {"bench_moe_layer": {"rows": [1, 2]}}


def test_collect_files_the_results_by_date_and_gpu_and_keeps_the_triton_cache(tmp_path):
    out = tmp_path / "files_at"
    (out / "src" / "logs").mkdir(parents=True)
    (out / "src" / "json").mkdir()
    (out / "src" / "logs" / "bench_moe_layer.log").write_text("MET\n")
    (out / "src" / "json" / "bench_moe_layer.json").write_text("{}")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(out / "src" / "logs", arcname="logs")
        tar.add(out / "src" / "json", arcname="json")
    (out / "triton-cache.tar.gz").write_bytes(b"cache bytes")
    (out / "summary.txt").write_text("summary\n")
    header = ["date: 2026-12-01T10:00:00Z", "gpu: NVIDIA H200, 580.159.03, 143771 MiB"]
    (out / "results.json").write_text(json.dumps({"header": header}))
    env = {"JETRL_RESULTS_ROOT": str(tmp_path / "results"),
           "JETRL_TRITON_CARRY": str(tmp_path / "carry")}  # fmt: skip
    p = sh("bash", SESSION, "--collect", out, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    dest = tmp_path / "results" / "2026-12-01_h200"
    assert sorted(f.name for f in dest.iterdir()) == [
        "bench_moe_layer.json", "bench_moe_layer.log", "results.json", "summary.txt",
    ]  # fmt: skip
    assert (tmp_path / "carry" / "triton-cache.tar.gz").read_bytes() == b"cache bytes"


def test_preflight_finds_function_level_imports_and_skips_optional_ones():
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    try:
        import session as session_py
    finally:
        sys.path.pop(0)
    found = session_py.script_imports(REPO / "benchmarks" / "gpu" / "bench_moe_layer.py")
    assert "nemo_jetrl.fp8.experts_layer" in found  # imported inside a function
    assert not [m for m in found if m.startswith("vllm")]  # inside try/except Exception
    found = session_py.script_imports(REPO / "benchmarks" / "gpu" / "bench_fp8_linear.py")
    assert "nemo_jetrl.fp8.gemm_backends" in found
    assert not [m for m in found if m.startswith("transformer_engine")]


# -- the stand-in of the bare image -------------------------------------------------------------


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_stand_in(dest: Path) -> Path:
    """Links to IMAGE_ROOTS and their requirements (extras left out), nothing else."""
    from packaging.requirements import Requirement

    dists: dict[str, md.Distribution] = {}
    todo = list(IMAGE_ROOTS)
    while todo:
        name = todo.pop()
        if _norm(name) in dists:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # a requirement this environment does without (the image has it or not)
        dists[_norm(name)] = dist
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    missing = [r for r in IMAGE_ROOTS if _norm(r) not in dists]
    assert not missing, f"this environment lacks {missing}: the stand-in cannot be made"
    dest.mkdir(parents=True)
    for dist in dists.values():
        site = Path(str(dist.locate_file("")))
        tops = {f.parts[0] for f in dist.files or [] if len(f.parts) and f.parts[0] != ".."}
        for top in tops:
            if top.endswith(".pth") or top in ("bin", "__pycache__") or (dest / top).exists():
                continue
            if (site / top).exists():
                (dest / top).symlink_to(site / top)
    return dest


def bare(target: Path | None, base: Path) -> dict:
    """The environment of a process that sees only the stdlib, the repo, `target` and `base`."""
    path = [str(REPO), *([str(target)] if target else []), str(base)]
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"),
           "PYTHONPATH": os.pathsep.join(path), "PYTHONNOUSERSITE": "1"}  # fmt: skip
    if "PYTHONPYCACHEPREFIX" in os.environ:
        env["PYTHONPYCACHEPREFIX"] = os.environ["PYTHONPYCACHEPREFIX"]
    return env


def run_bare(env: dict, *args, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-S", *map(str, args)], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def preflight_args(*extra: str) -> list[str]:
    return ["benchmarks/gpu/session.py", "preflight", "--no-cuda", *extra,
            "--bench", *BENCHES, "--tests", *gpu_test_modules()]  # fmt: skip


@pytest.mark.slow
def test_preflight_names_what_the_bare_image_lacks(tmp_path):
    base = image_stand_in(tmp_path / "image")
    p = run_bare(bare(None, base), *preflight_args())
    out = p.stdout + p.stderr
    assert p.returncode == 3, out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("preflight: FAILED"), verdict
    for name in ("pydantic", "omegaconf", "transformers", "pytest_timeout"):
        assert f"missing {name} (" in verdict, verdict


def pins() -> dict[str, str]:
    found = {}
    for line in WHEELS_TXT.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split()[0].split("==")
            found[_norm(name)] = version
    return found


def wheel_set(dest: Path, python: str) -> str:
    p = sh("bash", REPO / "scripts" / "gpu_wheels.sh", dest, env={"JETRL_GPU_WHEELS_PY": python},
           timeout=600)  # fmt: skip
    if p.returncode != 0:  # never a skip: CI reaches the registry
        pytest.fail(f"scripts/gpu_wheels.sh failed (registry unreachable?):\n{p.stdout}{p.stderr}")
    return p.stdout


def pip_install(wheels: Path, target: Path, *extra: str) -> None:
    assert not target.exists()
    p = sh(sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
           "--no-index", "--no-deps", "--no-compile", "--target", target, *extra,
           *sorted(wheels.glob("*.whl")))  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    installed = {_norm(d.name.split("-")[0]) for d in target.glob("*.dist-info")}
    assert installed == set(pins()), installed ^ set(pins())


@pytest.mark.slow
def test_the_wheel_set_alone_collects_the_gpu_tests_and_runs_the_local_grpo_step(tmp_path):
    # The set that travels: cp312 manylinux or pure Python, under 40 MiB, installs with the
    # device's tags (one version of each, nothing torch/triton/nvidia).
    travels = REPO / ".cache" / "gpu-wheels"
    out = wheel_set(travels, "3.12")
    mib = float(re.search(r"([\d.]+) MiB \(limit 40 MiB\)", out)[1])
    assert 0 < mib <= 40, out
    for whl in travels.glob("*.whl"):
        py_tag, _abi, plat = whl.stem.split("-")[-3:]
        assert py_tag in ("py3", "cp312") or re.fullmatch(r"cp3(\d+)", py_tag), whl.name
        assert plat == "any" or ("manylinux" in plat and plat.endswith("x86_64")), whl.name
        assert not re.match(r"(torch|triton|nvidia)", whl.name)
    pip_install(travels, tmp_path / "site312", *DEVICE_TAGS)

    # The same pins for this machine's Python, alone beside the image's own packages.
    twin = REPO / ".cache" / f"gpu-wheels-py{sys.version_info.major}.{sys.version_info.minor}"
    wheel_set(twin, f"{sys.version_info.major}.{sys.version_info.minor}")
    target = tmp_path / "site"
    pip_install(twin, target)
    env = bare(target, image_stand_in(tmp_path / "image"))

    # The device's preflight: every module the steps import, each benchmark with its
    # function-level imports, and every GPU test module collected (a module with no test or an
    # import error fails it); the carried packages come from the target.
    modules = gpu_test_modules()
    p = run_bare(env, *preflight_args())
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "preflight: OK" in out, out
    assert re.search(rf" \d+ tests in {len(modules)} of {len(modules)} modules;", out), out
    for dist in ("pydantic", "omegaconf", "transformers", "pytest-timeout"):
        assert re.search(rf"^preflight: version {dist} \S+ \({re.escape(str(target))}\)$", out,
                         re.M), (dist, out)  # fmt: skip
    assert re.search(rf"^preflight: version torch \S+ \({re.escape(str(tmp_path))}/image\)", out,
                     re.M), out  # fmt: skip

    # The most dependency-hungry step at run time (transformers, tokenizers, tensorboard): the
    # local GRPO benchmark's CPU smoke run, one exact and the off-policy recipe.
    p = run_bare(
        {**env, "TRITON_INTERPRET": "1"}, "benchmarks/gpu/bench_local_grpo.py", "--tiny",
        "--device", "cpu", "--steps", "1", "--models", "qwen3-0.6b-shaped",
        "--recipes", "fp8_rollout,jetrl_kv", timeout=300,
    )  # fmt: skip
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert re.search(r"jetrl_kv .* exactly on-policy: MET", out), out
    assert "FAILED" not in out, out


# -- the session script on CPU ------------------------------------------------------------------

STEP_LIMITS = ("PREFLIGHT", "INVARIANT_TESTS", "LOCAL_GRPO", "INVARIANT_OPS", "KERNEL_TESTS",
               "SERVING_FP32", "SERVING_POW2", "SERVING_SWEEP", "MOE", "LINEAR", "PROFILE_HOST",
               "PROFILE_KERNELS", "QUANT", "MOE_TILES", "FP8_TESTS")  # fmt: skip


def session(tmp_path: Path, name: str, carry: Path, run: tuple[str, ...], **env: str):
    out = tmp_path / name
    limits = {f"JETRL_{s}_S": "0" for s in STEP_LIMITS if s not in run}
    p = sh("bash", SESSION, out, timeout=400, env={
        "PYTHON": sys.executable, "JETRL_GPU_WHEELS_DIR": "", "JETRL_SESSION_NO_CUDA": "1",
        "JETRL_TRITON_CACHE_DIR": str(tmp_path / f"triton-{name}"), "JETRL_PREFLIGHT_S": "120",
        "JETRL_TRITON_CARRY": str(carry), "JETRL_SOURCE": "commit test", **limits, **env,
    })  # fmt: skip
    assert {f.name for f in out.iterdir()} <= {
        "logs.tar.gz", "results.json", "summary.txt", "triton-cache.tar.gz",
    }  # fmt: skip
    return p, out, (out / "summary.txt").read_text()


@pytest.mark.slow
def test_session_on_cpu_records_failed_steps_runs_the_next_and_keeps_the_triton_cache(tmp_path):
    carry = tmp_path / "carry"
    p, out, summary = session(
        tmp_path, "one", carry, ("PREFLIGHT", "INVARIANT_TESTS", "LINEAR", "FP8_TESTS")
    )
    assert p.returncode == 1, p.stdout + p.stderr  # steps failed (no GPU), none stopped the call
    assert sorted(f.name for f in out.iterdir()) == [
        "logs.tar.gz", "results.json", "summary.txt", "triton-cache.tar.gz",
    ]  # fmt: skip
    lines = summary.splitlines()
    assert lines[1] == "source: commit test"
    assert re.search(r"^== preflight rc=0 in \d+s \(limit 120s\)$", summary, re.M), summary
    for step in ("invariant_tests", "bench_fp8_linear", "fp8_tests"):
        assert re.search(rf"^== {step} rc=2 in \d+s", summary, re.M), summary  # each one ran
    assert "== bench_local_grpo skipped (limit 0)" in summary.splitlines()
    assert lines[-2:] == ["MET / NOT MET (0 lines from the steps' logs):", "(none)"]
    assert "triton cache: cold (no " in summary
    with tarfile.open(out / "logs.tar.gz") as tar:
        logs = {Path(n).name for n in tar.getnames() if n.endswith(".log")}
    assert logs == {"preflight.log", "invariant_tests.log", "bench_fp8_linear.log", "fp8_tests.log"}
    record = json.loads((out / "results.json").read_text())
    assert len(record["steps"]) == len(STEP_LIMITS)

    # The next call carries the cache back: reused under the same stamp only.
    carry.mkdir()
    (carry / "triton-cache.tar.gz").write_bytes((out / "triton-cache.tar.gz").read_bytes())
    p, _, summary = session(tmp_path, "two", carry, ("PREFLIGHT",))
    assert p.returncode == 0, summary
    assert re.search(r"^triton cache: reused \d+ files from ", summary, re.M), summary

    with tarfile.open(carry / "triton-cache.tar.gz", "w:gz") as tar:
        stamp = tmp_path / "STAMP"
        stamp.write_text("torch=0 triton=0 gpu=other\n")
        tar.add(stamp, arcname="./STAMP")
    p, _, summary = session(tmp_path, "three", carry, ("PREFLIGHT",))
    assert "triton cache: cold (carried cache not reused: made under 'torch=0 triton=0" in summary


@pytest.mark.slow
def test_a_failed_preflight_stops_the_call(tmp_path):
    p, out, summary = session(
        tmp_path, "stop", tmp_path / "carry", ("PREFLIGHT", "LINEAR"),
        JETRL_PREFLIGHT_REQUIRE="jetrl_no_such_module",
    )  # fmt: skip
    assert p.returncode == 3, p.stdout + p.stderr
    assert re.search(r"^== preflight rc=3 in", summary, re.M), summary
    assert re.search(r"^== bench_fp8_linear not run: the preflight failed \(limit \d+s\)$", summary,
                     re.M), summary  # fmt: skip
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames() if n.endswith(".log")}
        log = tar.extractfile("logs/preflight.log").read().decode()
    assert names == {"preflight.log"}
    assert "missing jetrl_no_such_module (needed by the session)" in log


def test_direct_launch_check_compares_launch_paths_and_says_which_ran():
    """The preflight's direct-launch check (its own process on the GPU; here the interpreter,
    where direct launches are off and every launch is JITFunction.run's)."""
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    p = sh(sys.executable, str(REPO / "benchmarks/gpu/session.py"), "direct-launch-check", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-1] == (
        "direct launch check: direct launches off (Triton's interpreter runs the kernels "
        "(TRITON_INTERPRET=1)); same bits as JITFunction.run"
    )


@pytest.mark.slow
def test_the_census_cache_is_unpacked_first_and_its_hits_said(tmp_path):
    """--prepare's sm_90 census cache (scripts/sm90_census.py --pack-cache): unpacked into the
    Triton cache before the call's start mark by scripts/census_cache.py when it was packed for
    that directory (Triton's index holds absolute paths) and this Triton computes its key, not
    otherwise (its cases: tests/test_census_cache.py); summary.txt says which, and how many
    kernels the call compiled itself (the preloaded ones are not counted)."""
    import triton
    import triton.runtime.cache as triton_cache

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import census_cache
    finally:
        sys.path.pop(0)
    ours = census_cache.libtriton_sha256()
    cache = tmp_path / "triton-census"

    def carry_with(name: str, version: str, root: Path) -> Path:
        carry = tmp_path / name
        carry.mkdir()
        meta = {"triton": version, "libtriton_sha256": ours, "root": str(root),
                "triton_key": triton_cache.triton_key(), "backend_hash": census_cache.backend_hash(),
                "tails": {"KERNELHASH": "-tail"}}  # fmt: skip
        files = {"KERNELHASH/k.json": b"{}", "KERNELHASH/k.cubin": b""}
        census_cache._write(carry / "sm90-census-cache.tar.gz", files, str(root), meta)
        return carry

    env = {"JETRL_TRITON_CACHE_DIR": str(cache)}
    p, _, summary = session(
        tmp_path, "census", carry_with("c1", triton.__version__, cache), ("PREFLIGHT",), **env
    )
    assert p.returncode == 0, summary
    assert (cache / "KERNELHASH" / "k.json").is_file()
    assert f"libtriton sha256 {ours[:16]}; this image: Triton {triton.__version__}" in summary
    assert "(the same: expect hits)" in summary
    compiled = re.search(r"^triton cache: (\d+) kernels compiled during this call$", summary, re.M)
    kernels = {p.name for p in cache.iterdir() if p.is_dir()} - {"KERNELHASH"}
    assert compiled and int(compiled[1]) == len(kernels), summary  # the preflight's own compiles

    other = tmp_path / "triton-other"
    env = {"JETRL_TRITON_CACHE_DIR": str(other)}
    p, _, summary = session(
        tmp_path, "census2", carry_with("c2", "0.0.1", other), ("PREFLIGHT",), **env
    )
    assert f"(differs: Triton {triton.__version__}, not 0.0.1; not unpacked: expect every kernel " \
        "compiled here)" in summary, summary  # fmt: skip
    assert not any(other.glob("KERNELHASH"))
    p, _, summary = session(
        tmp_path, "census3", carry_with("c3", triton.__version__, cache), ("PREFLIGHT",), **env
    )
    assert (
        f"sm90 census cache: not used (packed for {cache}, TRITON_CACHE_DIR is {other})" in summary
    )
