"""The one-call GPU session's results on CPU (docs/gpu.md): benchmarks/gpu/session.py's report
(summary.txt's verdict lines, results.json), device_session.sh --collect filing them by date and
GPU, and (slow) the whole session script run on CPU: failed steps recorded and the next run, the
Triton cache carried between calls, a failed preflight stopping the call, the sm_90 census cache
unpacked first.
"""

from __future__ import annotations

import json
import re
import sys
import tarfile
from pathlib import Path

import pytest
from gpu_session_helpers import REPO, SESSION, sh

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
