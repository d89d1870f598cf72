"""The Python half of `device_session.sh` (docs/gpu.md): its preflight and its report.

``python benchmarks/gpu/session.py preflight --tests FILE... --bench NAME... [--stamp PATH]``
imports every module the session's steps need and names each one missing, in one go: the
package's dependencies (pydantic, omegaconf, ...), each benchmark script and every module it
imports anywhere in its body (function-level imports included; an import inside a ``try`` that
catches ImportError/Exception is optional: vLLM, Transformer Engine), then collects the GPU test
modules (``pytest --collect-only``), checks pytest-timeout loads, and on a GPU compiles and runs
one Triton kernel. Exit 0 with ``preflight: OK ...``, 3 with ``preflight: FAILED ...`` naming
what is missing, 2 without a CUDA GPU (``--no-cuda``: the CPU test of the wheel set). ``--stamp``
writes the versions a Triton cache is valid for (torch, Triton, CUDA, driver, GPU).

``python benchmarks/gpu/session.py report WORK OUTDIR`` writes ``OUTDIR/summary.txt`` and
``OUTDIR/results.json`` from the session's work folder: ``steps.tsv`` (one line per step: name,
limit, rc, seconds, note), ``header.txt`` (preflight's device and version lines), ``source.txt``
(the tree that ran), ``logs/*.log`` and ``json/*.json`` (the benchmarks' records).
``summary.txt`` ends with every MET / NOT MET / NOT MEASURED line of every log, prefixed with
its step. Runs after each step, so a call stopped early still returns what ran.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / "benchmarks" / "gpu"
# What a bare CUDA image (torch, triton, numpy, pytest) lacks and the steps import: the carried
# wheel set (scripts/gpu_wheels.txt) provides each of these.
REQUIRED = (
    "torch", "triton", "numpy", "pytest", "pytest_timeout", "safetensors", "pydantic",
    "omegaconf", "yaml", "transformers", "tokenizers", "huggingface_hub", "nemo_jetrl",
)  # fmt: skip
# The distributions whose versions the summary names (where each was imported from tells whether
# the carried wheel or the image's own copy won).
VERSIONS = (
    "torch", "triton", "numpy", "pytest", "pytest-timeout", "pytest-xdist", "pydantic",
    "omegaconf", "transformers", "tokenizers", "safetensors",
)  # fmt: skip
VERDICT = re.compile(r"\b(NOT MET|MET|NOT MEASURED)\b")


def _optional(node: ast.Try) -> bool:
    """A ``try`` whose handlers catch a failed import (ImportError, Exception or bare)."""
    for h in node.handlers:
        names = []
        if h.type is None:
            return True
        for t in h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]:
            names.append(t.id if isinstance(t, ast.Name) else getattr(t, "attr", ""))
        if {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"} & set(names):
            return True
    return False


def script_imports(path: Path) -> list[str]:
    """Every module ``path`` imports anywhere (functions too), except optional ones."""
    found: list[str] = []

    def visit(node: ast.AST, optional: bool) -> None:
        if isinstance(node, ast.Try):
            for child in node.body:
                visit(child, optional or _optional(node))
            for child in (*node.handlers, *node.orelse, *node.finalbody):
                visit(child, optional)
            return
        if not optional and isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        elif (
            not optional
            and isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module not in (None, "__future__")
        ):
            found.append(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child, optional)

    visit(ast.parse(path.read_text(), str(path)), False)
    return list(dict.fromkeys(found))


def _try_import(name: str, missing: dict[str, set[str]], broken: dict[str, str], by: str) -> None:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing.setdefault(exc.name or name, set()).add(by)
    except Exception as exc:  # a module that is there but fails: name it with its error
        broken.setdefault(name, f"{type(exc).__name__}: {exc} (needed by {by})")


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        d = distribution(dist)
    except PackageNotFoundError:
        return f"{dist} -"
    where = Path(str(d.locate_file(""))).resolve()
    return f"{dist} {d.version} ({where})"


def stamp(cuda: bool) -> str:
    """What a compiled Triton kernel depends on: a cache is reused only under the same stamp."""
    import torch
    import triton

    parts = [f"torch={torch.__version__}", f"triton={triton.__version__}",
             f"cuda={torch.version.cuda}"]  # fmt: skip
    if cuda:
        drv = "unknown"
        with contextlib.suppress(Exception):
            drv = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout.split("\n")[0].strip()  # fmt: skip
        cap = "".join(map(str, torch.cuda.get_device_capability()))
        parts += [f"driver={drv}", f"gpu={torch.cuda.get_device_name()}", f"sm={cap}"]
    else:
        parts.append("gpu=none")
    return " ".join(parts)


def _triton_smoke() -> str:
    """Compile and run one Triton kernel: the toolchain (ptxas, the launcher's C compiler) works."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)

    x = torch.zeros(1000, device="cuda")
    add_one[(triton.cdiv(1000, 256),)](x, 1000, BLOCK=256)
    if not bool((x == 1).all()):
        raise RuntimeError("a Triton kernel ran and gave wrong values")
    return "a Triton kernel compiled and ran"


def preflight(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    missing: dict[str, set[str]] = {}
    broken: dict[str, str] = {}
    for name in (*REQUIRED, *args.require):
        _try_import(name, missing, broken, "the session")
    sys.path.insert(0, str(BENCH_DIR))
    for bench in args.bench:
        path = BENCH_DIR / f"{bench}.py"
        if not path.is_file():
            broken[bench] = f"no such script {path}"
            continue
        for name in [bench, *script_imports(path)]:
            _try_import(name, missing, broken, f"{bench}.py")
    collected = "not collected"
    if args.tests:
        import pytest

        buf = io.StringIO()
        with redirect_stdout(buf), redirect_stderr(buf):
            rc = pytest.main(["--collect-only", "-qq", "-p", "no:cacheprovider", *args.tests])
        out = buf.getvalue()
        counts = [int(m) for m in re.findall(r"^\S+\.py: (\d+)$", out, re.M)]
        collected = f"{sum(counts)} tests in {len(counts)} of {len(args.tests)} modules"
        if rc != 0 or len(counts) != len(args.tests):
            print(out.rstrip())
            for m in re.findall(r"ModuleNotFoundError: No module named '([\w.]+)'", out):
                missing.setdefault(m, set()).add("the GPU tests")
            broken["pytest --collect-only"] = f"exit {int(rc)}, {collected} (output above)"
    cuda = not args.no_cuda
    device = "no GPU asked for (--no-cuda)"
    if cuda and "torch" not in missing:
        import torch

        if not torch.cuda.is_available():
            print("preflight: FAILED: no CUDA GPU visible to torch", flush=True)
            return 2
        device = torch.cuda.get_device_name()
        if "triton" not in missing:
            try:
                device += f"; {_triton_smoke()}"
            except Exception as exc:
                broken["triton smoke kernel"] = "".join(traceback.format_exception_only(exc))
    for line in (_version(d) for d in VERSIONS):
        print(f"preflight: version {line}")
    if args.stamp and not missing and "torch" not in broken:
        Path(args.stamp).write_text(stamp(cuda) + "\n")
    secs = time.perf_counter() - t0
    if missing or broken:
        parts = [f"missing {m} (needed by {', '.join(sorted(by))})" for m, by in missing.items()]
        parts += [f"broken {k}: {v}" for k, v in broken.items()]
        print(f"preflight: FAILED in {secs:.1f} s: " + "; ".join(parts), flush=True)
        return 3
    print(
        f"preflight: OK in {secs:.1f} s: {len(REQUIRED)} modules, {len(args.bench)} benchmark "
        f"scripts with their imports, {collected}; {device}",
        flush=True,
    )
    return 0


def direct_launch_check() -> int:
    """Exit 0 when `triton_launch.launch`'s direct launches give JITFunction.run's bits on this
    GPU (or are off anyway), 1 when they differ; a crash is the caller's cue too. Run in its own
    process after the preflight: the session turns direct launches off for every later step
    when this fails (``JETRL_TRITON_DIRECT_LAUNCH=0``), instead of losing every FP8 step."""
    import torch

    from nemo_jetrl.fp8 import rowcol_quantize, triton_kernels, triton_launch

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter (CPU test)
    x = torch.randn(300, 640, device=dev, dtype=torch.bfloat16)
    runs = []
    for _ in range(3):  # the first of each kernel through JITFunction.run, the others direct
        q = triton_kernels.quantize_blockwise_triton(x, (1, 128), check_finite=False)
        r, c = rowcol_quantize.quantize_rowcol_triton(x, check_finite=False)
        runs.append([t.view(torch.uint8) if t.element_size() == 1 else t for t in
                     (q.data, q.scale_inv, r.data, r.scale_inv, c.data, c.scale_inv)])  # fmt: skip
    if dev == "cuda":
        torch.cuda.synchronize()
    on, why = triton_launch.direct_launch_status()
    same = all(torch.equal(a, b) for run in runs[1:] for a, b in zip(run, runs[0], strict=True))
    print(f"direct launch check: direct launches {'on' if on else 'off'} ({why}); "
          f"{'same bits as JITFunction.run' if same else 'OTHER BITS than JITFunction.run'}")  # fmt: skip
    return 0 if same else 1


def _read(path: Path, default: str = "") -> str:
    return path.read_text() if path.is_file() else default


def report(work: Path, out: Path) -> int:
    steps = []
    for line in _read(work / "steps.tsv").splitlines():
        name, limit, rc, secs, note = (line.split("\t") + [""] * 5)[:5]
        steps.append({"name": name, "limit_s": int(limit), "rc": None if rc == "" else int(rc),
                      "seconds": int(secs), "note": note})  # fmt: skip
    verdicts = []
    for log in sorted((work / "logs").glob("*.log"), key=lambda p: p.stat().st_mtime):
        for line in log.read_text(errors="replace").splitlines():
            if VERDICT.search(line):
                verdicts.append(f"{log.stem}: {line.strip()}")
    bench = {}
    for js in sorted((work / "json").glob("*.json")):
        try:
            bench[js.stem] = json.loads(js.read_text())
        except ValueError as exc:
            bench[js.stem] = {"unreadable": str(exc)}
    source = _read(work / "source.txt", "unknown (no source stamp carried)").strip()
    header = _read(work / "header.txt").rstrip("\n")
    lines = ["jetrl GPU session (benchmarks/gpu/device_session.sh; docs/gpu.md)",
             f"source: {source}"]  # fmt: skip
    lines += header.splitlines() if header else []
    for s in steps:
        if s["rc"] is None:
            limit = f" (limit {s['limit_s']}s)" if s["limit_s"] > 0 else ""
            lines.append(f"== {s['name']} {s['note'] or 'not run'}{limit}")
            continue
        tail = f" {s['note']}" if s["note"] else ""
        lines.append(
            f"== {s['name']} rc={s['rc']} in {s['seconds']}s (limit {s['limit_s']}s){tail}"
        )
    lines.append(f"MET / NOT MET ({len(verdicts)} lines from the steps' logs):")
    lines += verdicts or ["(none)"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    record = {"source": source, "header": header.splitlines(), "steps": steps,
              "verdicts": verdicts, "bench": bench}  # fmt: skip
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("preflight", help="import and collect everything the steps need")
    p.add_argument("--tests", nargs="*", default=[], help="GPU test modules to collect")
    p.add_argument("--bench", nargs="*", default=[], help="benchmark scripts (names, no .py)")
    p.add_argument("--require", nargs="*", default=[], help="more modules that must import")
    p.add_argument("--no-cuda", action="store_true", help="no GPU checks (the CPU test)")
    p.add_argument("--stamp", default=None, help="write the Triton cache stamp here")
    sub.add_parser("direct-launch-check", help="direct Triton launches give the same bits")
    r = sub.add_parser("report", help="summary.txt and results.json from a work folder")
    r.add_argument("work", type=Path)
    r.add_argument("out", type=Path)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "preflight":
        os.chdir(REPO)
        return preflight(args)
    if args.cmd == "direct-launch-check":
        os.chdir(REPO)
        return direct_launch_check()
    return report(args.work, args.out)


if __name__ == "__main__":
    sys.exit(main())
