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
3. **Each launch is compiled by Triton's own JIT** (``JITFunction.run(..., warmup=True)``) for
   ``GPUTarget("cuda", 90, 32)`` (`_Hopper`, the driver it asks): its specialization (pointer
   dtypes and 16-byte alignment, ints equal to 1 or divisible by 16, TMA descriptors), its cache
   key and its cache entry, exactly as on a GPU. ``--pack-cache`` packs those entries under the
   GPU image's key for a GPU call to carry (docs/gpu.md, "The census cache").

Checked (exit 1, naming each failing specialization): every one compiles; its shared memory fits
Hopper's 227 KiB; it spills no register (ptxas -v for sm_90a); it moves no data one or two bytes
at a time (``ld/st.global`` of ``b8`` or ``v2.b8``); a kernel whose bits follow its source op for
op (`UNFUSED`) leaves no add/sub/mul free to fuse into an fma; the FP8 and batch-invariant dots
are ``wgmma`` and never ``mma.sync``; a batch-invariant kernel (`INVARIANT`) launches with the
same tiles, the same MMA instruction and the same count of every floating-point instruction
(`sm90_ptx.ARITH`) at every batch size its workload launches, as one compiled kernel (the ints a
batch sets are not specialised: a decode step and a prefill run the same machine code). Not
shown: time, and bits on a GPU (the GPU call's steps measure both).

Usage: ``python scripts/sm90_census.py [--json OUT]`` with the installed Triton, or
``PYTHONPATH=.venv-triton-gpu python scripts/sm90_census.py`` with the GPU image's
(``scripts/setup_env.sh`` installs it there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import census_cache
import sm90_ptx

HOPPER_SMEM = 232448  # bytes one block may use on an H100/H200, as Triton states it (H100 log)
# The batch-invariant kernels, with the constexprs that may differ between their launches (feature
# dimensions): launches that agree on these and on their tensors' dtypes must agree on every other
# constexpr (IEEE, IN_BF16: chosen from the dtype, never from the batch), option,
# MMA instruction and floating-point instruction count, whatever the batch size (a tile chosen
# from M, or an M == 1 path, would change a row's bits).
# And they must be one compiled kernel: the ints a batch sets (the second tuple: row and key
# counts, and the mask strides they make) are not specialised (their ``do_not_specialize``), so
# launches that agree on the rest share one binary at every batch size.
# The split-K GEMM is not here: its token tile N grows with M by design, and its own test holds
# the wgmma family (m64nXk32) that keeps a row's bits (tests/fp8/test_split_gemm.py).
INVARIANT = {"matmul_kernel": ((), ("M",)), "attention_kernel": (("BD",), ("Tq", "Tk", "smb", "smq")),
             "rms_rstd_kernel": ((), ()), "logsumexp_kernel": ((), ())}  # fmt: skip
# Kernels whose dot is an FP8 (or batch-invariant) tensor-core dot: wgmma, never mma.sync.
TENSOR_CORE = (
    "block_fp8_gemm_kernel", "split_gemm_kernel", "grouped_rows_gemm_kernel",
    "grouped_tokens_gemm_kernel", "matmul_kernel", "attention_kernel",
)  # fmt: skip
# Kernels whose bits must follow their source op for op whatever the code's layout (the invariant
# attention at any pipeline depth; the MoE SiLU rule and combine, equal to torch's rule): launched
# with enable_fp_fusion=False (`triton_launch.NO_FMA`), so no add/sub/mul of theirs may lack a
# rounding mode (`sm90_ptx.unrounded`), which is what lets LLVM or ptxas fuse it into an fma.
UNFUSED = ("attention_kernel", "silu_mul_quantize_kernel", "combine_kernel")
# Register spills measured and accepted (ptxas -v for sm_90a, Triton 3.6 and 3.9, 2026-11-29), each
# (kernel, the constexprs or launch options it applies to, and "triton": "3.9" where only that
# version spills, why); a spill anywhere else fails the census.
KNOWN_SPILLS = (
    ("attention_kernel", {"IEEE": True}, "fp32 attention (jetrl.local.dtype float32) multiplies "
     "on Triton's FMA dot: 64 x 64 fp32 tiles do not fit in registers (tens of KB of local "
     "memory); the GPU path is bf16, the default"),
    ("attention_kernel", {"IEEE": False, "BD": 256}, "head_dim 256: 0.4-1 KB at 255 registers"),
    ("attention_kernel", {"IEEE": False, "BD": 128}, "the prefill: 16-24 bytes at 255 registers"),
    ("matmul_kernel", {"IEEE": True}, "fp32 lm_head (dtype float32): 8 bytes at 128 registers"),
    # Two tiles the GPU call's quantizer sweep times (bench_quantizer_bandwidth.py), spilling with
    # the installed Triton 3.9's code only; with the GPU image's 3.6 neither spills.
    ("quantize_kernel", {"MODE": 2, "TK": 32, "triton": "3.9"}, "128x1 at 128 x 32, untransposed "
     "output (the transposed one, the trainer's, does not): 48 bytes of local memory at 96 "
     "registers"),
    ("quantize_rowcol_kernel", {"num_warps": 16, "triton": "3.9"}, "16 warps cap a thread at "
     "128 registers: 72 bytes (3.6: 118 registers, none)"),
)  # fmt: skip
_OPTIONS = (
    "num_warps",
    "num_stages",
    "num_ctas",
    "maxnreg",
    "enable_reflect_ftz",
    "enable_fp_fusion",
    "launch_pdl",
)


# ------------------------------------------------------------------------------- the recorder

CALLS: list[dict] = []
_WORKLOAD = ["?"]
_JIT_RUN: list = []  # Triton's own JITFunction.run, kept by `record_launches`


def record_launches() -> None:
    """Replace `JITFunction.run`: append the launch to `CALLS`, launch nothing."""
    from triton.runtime.jit import JITFunction

    _JIT_RUN.append(JITFunction.run)

    def run(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        CALLS.append({"kernel": self, "args": args, "kwargs": kwargs, "workload": _WORKLOAD[0]})

    JITFunction.run = run  # type: ignore[method-assign]


class _Hopper:
    """The driver the JIT asks for its device: 0, an sm_90 (labelled fake: nothing is launched)."""

    def get_current_device(self) -> int:
        return 0

    get_current_stream = staticmethod(lambda device=None: 0)  # the JIT passes it to no launch

    def get_current_target(self):  # type: ignore[no-untyped-def]
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def _report_fields(call: dict) -> tuple[dict, dict, dict, list]:
    """(constexprs by name, launch options, int arguments, tensor dtypes) of one launch."""
    kernel, kwargs = call["kernel"], call["kwargs"]
    bound = dict(zip(kernel.arg_names, call["args"], strict=False))
    consts = {}
    for p in kernel.params:
        if p.is_constexpr:
            v = kwargs.get(p.name, bound.get(p.name, p.default))
            consts[p.name] = v if isinstance(v, int | float | bool | str | type(None)) else str(v)
    ints = {n: a for n, a in bound.items() if type(a) is int}
    dtypes = [str(a.dtype).removeprefix("torch.") for a in bound.values() if hasattr(a, "dtype")]
    return consts, {k: kwargs[k] for k in _OPTIONS if k in kwargs}, ints, dtypes


def compile_all(calls: list[dict]) -> list[dict]:
    """Compile each launch of ``calls`` for sm_90 through Triton's own JIT (``warmup=True``: its
    specialization, cache key and cache, no launch); one report row per distinct kernel."""
    from triton.runtime.driver import driver

    driver.set_active(_Hopper())
    rows: dict[str, dict] = {}
    for call in calls:
        consts, options, ints, dtypes = _report_fields(call)
        name = call["kernel"].__name__
        try:
            k = _JIT_RUN[0](call["kernel"], *call["args"], grid=(1,), warmup=True, **call["kwargs"])
            key, found = k.hash, {"shared": k.metadata.shared, "ptx": k.asm.get("ptx")}
        except Exception as exc:  # reported by name; the census goes on
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
            key, found = repr((name, consts, options, error)), {"error": error}
        row = rows.get(key)
        if row is None:  # a new kernel binary
            row = rows[key] = {"kernel": name, "workloads": set(), "consts": consts,
                               "options": options, "ints": {}, "dtypes": dtypes,
                               "batch_args": _unspecialized(call["kernel"])}  # fmt: skip
            if "error" in found:
                row["error"] = found["error"]
            else:
                ptx = found["ptx"]  # None: a binary-only cache entry (nothing to read)
                row["shared"] = found["shared"]
                row["mma"] = None if ptx is None else sorted(set(sm90_ptx.MMA.findall(ptx)))
                row["arith"] = None if ptx is None else dict(Counter(sm90_ptx.ARITH.findall(ptx)))
                row["shared_byte_accesses"] = (
                    None if ptx is None else len(sm90_ptx.SHARED_BYTE_ACCESS.findall(ptx))
                )
                row["byte_accesses"] = (
                    None if ptx is None else len(sm90_ptx.BYTE_ACCESS.findall(ptx))
                )
                row["async_copies"] = None if ptx is None else len(sm90_ptx.ASYNC_COPY.findall(ptx))
                row["tma_copies"] = None if ptx is None else len(sm90_ptx.TMA_COPY.findall(ptx))
                row["l2_prefetches"] = (
                    None if ptx is None else len(sm90_ptx.L2_PREFETCH.findall(ptx))
                )
                row["pdl_waits"] = None if ptx is None else len(sm90_ptx.PDL_WAIT.findall(ptx))
                row["ptx"] = ptx  # ptxas -v below, all kernels at once
        row["workloads"].add(call["workload"])
        for n, a in ints.items():
            row["ints"].setdefault(n, set()).add(a)
    out = list(rows.values())
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # ptxas runs outside the GIL
        usage = list(pool.map(sm90_ptx.ptxas_usage, [row.pop("ptx", None) for row in out]))
    for row, (registers, spill_bytes) in zip(out, usage, strict=True):
        if "error" not in row:
            row["registers"], row["spill_bytes"] = registers, spill_bytes
    for row in out:
        row["workloads"] = sorted(row["workloads"])
        row["ints"] = {n: sorted(v) for n, v in row["ints"].items()}
    return out


def known_spill(row: dict) -> str | None:
    """Why ``row``'s register spills are accepted (`KNOWN_SPILLS`), or None."""
    import triton

    facts = {
        **row["options"],
        **row["consts"],
        "triton": ".".join(triton.__version__.split(".")[:2]),
    }
    for kernel, match, why in KNOWN_SPILLS:
        if row["kernel"] == kernel and all(facts.get(k) == v for k, v in match.items()):
            return why
    return None


def problems(rows: list[dict]) -> list[str]:
    """What fails the census (the module docstring's checks), one line each."""
    out = []
    for r in rows:
        where = f"{r['kernel']} {r['consts']} options {r['options']} ({', '.join(r['workloads'])})"
        if "error" in r:
            out.append(f"does not compile: {where}: {r['error']}")
            continue
        if r["mma"] is None:
            out.append(
                f"no PTX to read (a binary-only cache entry; empty TRITON_CACHE_DIR): {where}"
            )
            continue
        if r["shared"] > HOPPER_SMEM:
            out.append(f"{r['shared']} B of shared memory > Hopper's {HOPPER_SMEM}: {where}")
        if r.get("spill_bytes") and known_spill(r) is None:
            out.append(
                f"{r['spill_bytes']} bytes of register spills ({r['registers']} registers): {where}"
            )
        if r.get("byte_accesses"):
            out.append(f"{r['byte_accesses']} global loads/stores of one or two bytes: {where}")
        if r["consts"].get("PACK") and r.get("shared_byte_accesses"):
            out.append(f"{r['shared_byte_accesses']} shared-memory byte accesses in a packed-word "
                       f"kernel: {where}")  # fmt: skip
        loose = sm90_ptx.unrounded(r["arith"])
        if r["kernel"] in UNFUSED and (r["options"].get("enable_fp_fusion", True) or loose):
            out.append(f"fusable arithmetic (enable_fp_fusion not False, or {loose} add/sub/mul "
                       f"without a rounding mode): {where}")  # fmt: skip
        if r["kernel"] in TENSOR_CORE and any(m.startswith("mma.sync") for m in r["mma"]):
            out.append(f"mma.sync (not wgmma) in {where}: {r['mma']}")
    for name, (free, batch_ints) in INVARIANT.items():
        groups: dict[str, set] = {}
        for r in rows:
            if r["kernel"] == name and "error" not in r:
                fixed = ({k: v for k, v in r["consts"].items() if k in free}, r.get("dtypes"))
                rest = {k: v for k, v in r["consts"].items() if k not in free}
                arith = sorted((r["arith"] or {}).items())  # how many of each instruction
                groups.setdefault(repr(fixed), set()).add(
                    repr((rest, r["options"], r["mma"], arith))
                )
        for fixed, seen in groups.items():
            if len(seen) > 1:
                out.append(f"{name} {fixed} launches differ across batch sizes: {sorted(seen)}")
        # one compiled kernel per feature shape (the ints no batch sets, as Triton specialises)
        binaries: dict[str, list] = {}
        for r in rows:
            if r["kernel"] == name and "error" not in r:
                shape = {n: (v[0] == 1, v[0] % 16 == 0) for n, v in r["ints"].items()
                         if n not in batch_ints}  # fmt: skip
                fixed = ({k: v for k, v in r["consts"].items() if k in free}, r.get("dtypes"))
                binaries.setdefault(repr((fixed, shape)), []).append(r)
        for key, same in binaries.items():
            if len(same) > 1:
                specialised = sorted(set(batch_ints) - set(same[0].get("batch_args", ())))
                out.append(f"{name} {key}: {len(same)} compiled kernels at its batch sizes, not "
                           f"one (specialised on {specialised}: not in its do_not_specialize)")  # fmt: skip
    return out


def _unspecialized(kernel) -> list[str]:  # type: ignore[no-untyped-def]
    """The kernel's parameters Triton does not specialise (``do_not_specialize``)."""
    return sorted(p.name for p in kernel.params if getattr(p, "do_not_specialize", False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the report (rows and problems) here")
    from sm90_workloads import WORKLOADS, pretend_h100

    parser.add_argument("--only", nargs="*", choices=list(WORKLOADS), help="these workloads")
    parser.add_argument(
        "--pack-cache", type=Path, metavar="TARBALL",
        help="compile into a fresh cache under the GPU image's cache key and pack it here for a "
        "GPU call to carry (device_session.sh --prepare); with the GPU image's Triton only",
    )  # fmt: skip
    parser.add_argument(
        "--cache-root",
        default=census_cache.DEVICE_CACHE_DIR,
        help=f"where the packed cache will be unpacked (default {census_cache.DEVICE_CACHE_DIR})",
    )
    parser.add_argument(
        "--image-key",
        action="store_true",
        help="compile under the GPU image's cache key (implied by --pack-cache)",
    )
    args = parser.parse_args(argv)
    # Set before any kernel module loads (the workloads import them): the compiler's host paths.
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["JETRL_TRITON_DIRECT_LAUNCH"] = "0"  # every launch through JITFunction.run
    import triton

    if tuple(map(int, triton.__version__.split(".")[:2])) >= (3, 9):
        # 3.9 warns when it is unset; 3.6 keys its cache on it, and the device leaves it unset
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cache_dir, image = None, None
    if args.pack_cache or args.image_key:
        if triton.__version__ != census_cache.GPU_IMAGE_TRITON:
            parser.error(f"the GPU image's cache key needs its Triton "
                         f"{census_cache.GPU_IMAGE_TRITON}, not {triton.__version__}")  # fmt: skip
        image = census_cache.ImageKey()
    if args.pack_cache:
        import tempfile

        cache_dir = Path(tempfile.mkdtemp(prefix="jetrl-census-cache-"))
        os.environ["TRITON_CACHE_DIR"] = str(cache_dir)  # fresh: every kernel compiled, PTX kept

    pretend_h100()
    record_launches()
    for name in args.only or WORKLOADS:
        _WORKLOAD[0] = name
        WORKLOADS[name]()
    rows = compile_all(CALLS)
    found = problems(rows)
    for r in rows:
        mma = (
            "(no PTX: read from a binary-only cache)"
            if r.get("mma") is None
            else " ".join(r["mma"])
        )
        body = r.get("error") or f"smem {r['shared']:>6}  regs {r['registers']}  {mma}"
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
    if cache_dir is not None and image is not None and not found:
        meta = {**image.meta(), "launches": len(CALLS)}
        n = census_cache.pack_cache(cache_dir, args.pack_cache, args.cache_root, meta)
        shutil.rmtree(cache_dir)
        size = args.pack_cache.stat().st_size / 2**20
        print(f"packed {n} kernels for the GPU image into {args.pack_cache} ({size:.1f} MiB)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
