"""The one-call GPU session's preflight on CPU (docs/gpu.md): benchmarks/gpu/session.py finds
the benchmarks' function-level imports and runs its direct-launch check; (slow) the wheel set
alone collecting the GPU tests and passing the preflight in a stand-in of the bare GPU image, and
the bare image without it failing the preflight by name.

The stand-in of the image: `python -S` (no site-packages) with PYTHONPATH = the repository, an
empty `--target` holding only the wheel set, and a folder of links to what the image itself has
that the steps use (torch, triton, numpy, pytest, tensorboard and what they require; KINDS.md of
the device tool lists each). The image runs Python 3.12 and this machine 3.11, so the stand-in
installs the same pins fetched for 3.11 (`JETRL_GPU_WHEELS_PY=3.11`); the cp312 set that travels
is installed with the device's tags into its own empty target.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_session_helpers import REPO, gpu_test_modules, sh

WHEELS_TXT = REPO / "scripts" / "gpu_wheels.txt"
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


# -- the preflight's own checks -----------------------------------------------------------------


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
