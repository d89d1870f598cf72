"""Every Triton kernel the GPU paths launch, compiled for Hopper (sm_90) on a machine without a GPU.

A GPU call is 15 minutes, and the GPU image has its own Triton (3.6; this machine's may be newer):
a kernel that does not compile there, or asks for more shared memory than Hopper has, costs the
steps that launch it. This finds that here. Three parts:

1. **The host code believes it runs on an H100** (`sm90_workloads.pretend_h100`, a labelled fake: only what no CPU
   can give). CPU tensors answer ``is_cuda`` True; torch.cuda reports capability (9, 0) and 132
   SMs; the few module-level choices that read the device type are set to an H100's (the FP8
   tensor-core dot, the hardware FP8 cast). Everything else (tile sizes, launch modes, strides,
   the interpreter-or-compiler switches) is the host code's own, compiler side
   (``TRITON_INTERPRET=0``).
2. **Each launch is recorded, not run** (`JITFunction.run` replaced): the kernel, its arguments,
   its constexprs and options. The workloads (`sm90_workloads.WORKLOADS`) are the GPU call's shapes: Qwen3-8B's
   serving linears at M = 1..8192 on both Triton backends and scale modes, the training linear's
   quantizers at 8192 tokens, the routed experts of Qwen3-30B-A3B and DeepSeek-V3 at decode and
   prefill, the batch-invariant ops at the ~0.6B model's shapes.
3. **Each distinct specialization is compiled** by Triton's own compiler for
   ``GPUTarget("cuda", 90, 32)``, specialized as the JIT would (pointer dtypes, 16-byte alignment,
   ints equal to 1 made constants, multiples of 16 marked divisible, TMA descriptors typed).

Checked (exit 1, naming each failing specialization): every one compiles; its shared memory fits
Hopper's 227 KiB; the FP8 and batch-invariant dots are ``wgmma`` and never ``mma.sync``; a
batch-invariant kernel (`INVARIANT`) multiplies with one instruction at every batch size its
workload launches. Not shown: time, and bits on a GPU (the GPU call's steps measure both).

Usage: ``python scripts/sm90_census.py [--json OUT]`` with the installed Triton, or
``PYTHONPATH=.venv-triton-gpu python scripts/sm90_census.py`` with the GPU image's
(``scripts/setup_env.sh`` installs it there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

HOPPER_SMEM = 232448  # bytes one block may use on an H100/H200, as Triton states it (H100 log)
# The batch-invariant kernels, with the constexprs that may differ between their launches (feature
# dimensions, dtypes): launches that agree on these must agree on every other constexpr, option
# and MMA instruction, whatever the batch size (a tile chosen from M would change a row's bits).
# The split-K GEMM is not here: its token tile N grows with M by design, and its own test holds
# the wgmma family (m64nXk32) that keeps a row's bits (tests/fp8/test_split_gemm.py).
INVARIANT = {"matmul_kernel": ("IEEE",), "attention_kernel": ("BD", "IEEE")}
# Kernels whose dot is an FP8 (or batch-invariant) tensor-core dot: wgmma, never mma.sync.
TENSOR_CORE = (
    "block_fp8_gemm_kernel", "split_gemm_kernel", "grouped_rows_gemm_kernel",
    "grouped_tokens_gemm_kernel", "matmul_kernel", "attention_kernel",
)  # fmt: skip
_TYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
    torch.int32: "i32", torch.int16: "i16", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
}  # fmt: skip
_OPTIONS = (
    "num_warps",
    "num_stages",
    "num_ctas",
    "maxnreg",
    "enable_reflect_ftz",
    "enable_fp_fusion",
)


# ------------------------------------------------------------------------------- the recorder

CALLS: list[dict] = []
_WORKLOAD = ["?"]


def record_launches() -> None:
    """Replace `JITFunction.run`: append the launch to `CALLS`, launch nothing."""
    from triton.runtime.jit import JITFunction

    def run(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        CALLS.append({"kernel": self, "args": args, "kwargs": kwargs, "workload": _WORKLOAD[0]})

    JITFunction.run = run  # type: ignore[method-assign]


def _spec(call: dict) -> tuple[dict, dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options, what) of one recorded launch, as the JIT makes them."""
    kernel, kwargs = call["kernel"], dict(call["kwargs"])
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    sig, consts, attrs, what = {}, {}, {}, {}
    bound = dict(zip(kernel.arg_names, call["args"], strict=False))
    for i, p in enumerate(kernel.params):
        name = p.name
        if name in bound:
            a = bound[name]
        elif name in kwargs:
            a = kwargs[name]
        else:
            a = p.default
        if p.is_constexpr:
            sig[name], consts[name] = "constexpr", a
            what[name] = a if isinstance(a, int | float | bool | str | type(None)) else str(a)
            continue
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + _TYPES[a.dtype]
            aligned = a.data_ptr() % 16 == 0
        elif a.__class__.__name__ == "TensorDescriptor":
            sig[name] = f"tensordesc<{_TYPES[a.base.dtype]}{list(a.block_shape)}>"
            aligned = False
        elif isinstance(a, bool):
            sig[name], aligned = "i1", False
        elif isinstance(a, int):
            if a == 1 and not p.do_not_specialize:
                sig[name], consts[name] = "constexpr", 1
                continue
            sig[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
            aligned = a % 16 == 0 and not p.do_not_specialize
        elif isinstance(a, float):
            sig[name], aligned = "fp32", False
        elif a is None:
            sig[name], consts[name] = "constexpr", None
            continue
        else:
            raise TypeError(f"{kernel.__name__}: argument {name} of type {type(a)} not handled")
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs, options, what


def compile_all(calls: list[dict]) -> list[dict]:
    """Compile each distinct specialization of ``calls`` for sm_90; one report row each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows, seen = [], {}
    for call in calls:
        sig, consts, attrs, options, what = _spec(call)
        key = repr((call["kernel"].__name__, sorted(sig.items()), sorted(map(repr, consts.items())),
                    sorted(attrs), sorted(options.items())))  # fmt: skip
        ints = {
            n: a
            for n, a in zip(call["kernel"].arg_names, call["args"], strict=False)
            if type(a) is int
        }
        if key in seen:  # the same compiled kernel: note the workload and the int values
            seen[key]["workloads"].add(call["workload"])
            for n, a in ints.items():
                seen[key]["ints"].setdefault(n, set()).add(a)
            continue
        row = {
            "kernel": call["kernel"].__name__,
            "workloads": {call["workload"]},
            "consts": what,
            "options": options,
            "ints": {n: {a} for n, a in ints.items()},
        }
        seen[key] = row
        try:
            src = ASTSource(fn=call["kernel"], signature=sig, constexprs=consts, attrs=attrs)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        except Exception as exc:  # reported by name; the census goes on
            row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
        else:
            ptx = k.asm["ptx"]
            row.update(
                shared=k.metadata.shared,
                mma=sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync)\S*", ptx))),
            )
        rows.append(row)
    for row in rows:
        row["workloads"] = sorted(row["workloads"])
        row["ints"] = {n: sorted(v) for n, v in row["ints"].items()}
    return rows


def problems(rows: list[dict]) -> list[str]:
    """What fails the census (the module docstring's checks), one line each."""
    out = []
    for r in rows:
        where = f"{r['kernel']} {r['consts']} options {r['options']} ({', '.join(r['workloads'])})"
        if "error" in r:
            out.append(f"does not compile: {where}: {r['error']}")
            continue
        if r["shared"] > HOPPER_SMEM:
            out.append(f"{r['shared']} B of shared memory > Hopper's {HOPPER_SMEM}: {where}")
        if r["kernel"] in TENSOR_CORE and any(m.startswith("mma.sync") for m in r["mma"]):
            out.append(f"mma.sync (not wgmma) in {where}: {r['mma']}")
    for name, free in INVARIANT.items():
        groups: dict[str, set] = {}
        for r in rows:
            if r["kernel"] == name and "error" not in r:
                fixed = {k: v for k, v in r["consts"].items() if k in free}
                rest = {k: v for k, v in r["consts"].items() if k not in free}
                groups.setdefault(repr(fixed), set()).add(repr((rest, r["options"], r["mma"])))
        for fixed, seen in groups.items():
            if len(seen) > 1:
                out.append(f"{name} {fixed} launches differ across batch sizes: {sorted(seen)}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the report (rows and problems) here")
    from sm90_workloads import WORKLOADS, pretend_h100

    parser.add_argument("--only", nargs="*", choices=list(WORKLOADS), help="these workloads")
    args = parser.parse_args(argv)
    # Set before any kernel module loads (the workloads import them): the compiler's host paths.
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["JETRL_TRITON_DIRECT_LAUNCH"] = "0"  # every launch through JITFunction.run
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # 3.9's default made explicit (3.6's)
    import triton

    pretend_h100()
    record_launches()
    for name in args.only or WORKLOADS:
        _WORKLOAD[0] = name
        WORKLOADS[name]()
    rows = compile_all(CALLS)
    found = problems(rows)
    for r in rows:
        body = r.get("error") or f"smem {r['shared']:>6}  {' '.join(r['mma'])}"
        print(f"{r['kernel']:28s} {','.join(r['workloads']):30s} {body}")
    print(f"triton {triton.__version__}: {len(CALLS)} launches, {len(rows)} specializations, "
          f"{len(found)} problems")  # fmt: skip
    for line in found:
        print("PROBLEM:", line)
    if args.json:
        sources = {n: m.__file__ for n, m in sys.modules.items() if n.startswith("nemo_jetrl.")}
        report = {"triton": triton.__version__, "launches": len(CALLS), "rows": rows,
                  "problems": found, "sources": sources}  # fmt: skip
        args.json.write_text(json.dumps(report, default=str, indent=1))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
