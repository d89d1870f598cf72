"""What `sm90_census` reads in a kernel's PTX: its MMA instructions, its floating-point
arithmetic (`ARITH`: what decides a value's bits), its global accesses of one or two bytes, its
asynchronous global-to-shared copies (`ASYNC_COPY`: a software-pipelined load; `TMA_COPY`), the
add/sub/mul that carry no rounding mode (`unrounded`: ptxas may fuse those into an fma), and
ptxas's register and spill report for sm_90a (`ptxas_usage`, kept per PTX text).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

MMA = re.compile(r"(?:wgmma\.mma_async|mma\.sync)\S*")
# The floating-point arithmetic of a kernel's PTX, each instruction with its rounding and type
# (what decides a value's bits; loads, stores, masks and integer index math are left out).
ARITH = re.compile(
    r"^\s*(?:@%p\d+\s+)?((?:wgmma\.mma_async|mma\.sync|fma|add|sub|mul|div|rcp|sqrt|rsqrt|ex2|lg2"
    r"|max|min|neg|abs)\.\S*f(?:16|32|64)\S*|cvt\.\S*(?:f16|bf16|f32|f64|e4m3|e5m2)\S*)",
    re.M,
)

# A global load or store of one or two bytes (FP8 codes moved a byte at a time: the compiler did
# not know the addresses 16-aligned or contiguous, e.g. the MoE WGrad's token layout before its
# 16-aligned offsets). A kernel moving FP8 data should move 16 bytes a lane.
BYTE_ACCESS = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?(?:ld|st)\.global(?:\.(?!v\d)[a-zA-Z][\w:]*)*(?:\.v2)?\.[bsu]8\b", re.M
)

# A shared-memory load or store of one byte: a layout conversion of FP8 codes moved a byte at a
# time (the 128x1 quantizer's transposed output, 64 a thread at (128, 64, 4) on Triton 3.6); the
# packed-word kernels (`_triton_jit._quantize_cols_packed`) must have none.
SHARED_BYTE_ACCESS = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?(?:ld|st)\.shared(?:\.(?!v\d)[a-zA-Z][\w:]*)*(?:\.v\d)?\.[bsu]8\b", re.M
)

# cp.async: a load Triton's pipeliner issues ahead of its use into shared memory (num_stages > 1);
# a loop's loads without it wait for memory in every iteration.
ASYNC_COPY = re.compile(r"^\s*(?:@!?%p\d+\s+)?cp\.async\.c[ag]\.shared", re.M)
# cp.async.bulk.tensor: a TMA copy (a tensor descriptor's block into shared memory, one thread
# issuing it for the whole block).
TMA_COPY = re.compile(r"^\s*(?:@!?%p\d+\s+)?cp\.async\.bulk\.tensor", re.M)
# cp.async.bulk.prefetch.L2: a bulk prefetch into L2 (a hint; the split-K kernel's
# SPLIT_PREFETCH variant issues one per weight row, from inline assembly).
L2_PREFETCH = re.compile(r"cp\.async\.bulk\.prefetch\.L2\.global")
# griddepcontrol.wait: where a programmatic dependent launch waits for the kernel before it (the
# split-K kernel's SPLIT_PDL variant, from Triton's gdc_wait).
PDL_WAIT = re.compile(r"griddepcontrol\.wait")


# ptxas -v's answers, one small file per (ptxas binary, PTX text): a census over a warm Triton
# cache ran ptxas on all ~90 kernels again, ~8 of its ~21 s on 2 cores; a kernel whose PTX
# changed (another tile, a mutant) is a new key and runs ptxas.
PTXAS_CACHE_VAR = "JETRL_PTXAS_CACHE"  # default ~/.cache/nemo_jetrl/ptxas


def ptxas_usage(ptx: str | None) -> tuple[int | None, int | None]:
    """(registers a thread, spill store + load bytes) as ptxas reports them for sm_90a: Triton's
    own ptxas, run as Triton runs it (``-v``), on the kernel's PTX (None: no PTX); kept under
    `PTXAS_CACHE_VAR` by the binary's path, version and size and the PTX's hash."""
    import hashlib
    import subprocess
    import tempfile
    import threading

    from triton.backends.nvidia.compiler import get_ptxas

    if ptx is None:
        return None, None
    ptxas = get_ptxas(90)
    ident = f"{ptxas.path}\0{ptxas.version}\0{os.stat(ptxas.path).st_size}\0sm_90a\0"
    root = os.environ.get(PTXAS_CACHE_VAR) or Path.home() / ".cache" / "nemo_jetrl" / "ptxas"
    kept = Path(root) / f"{hashlib.sha256((ident + ptx).encode()).hexdigest()}.json"
    if kept.is_file():
        registers, spill_bytes = json.loads(kept.read_text())
        return registers, spill_bytes
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        cmd = [ptxas.path, "-v", "--gpu-name=sm_90a", str(src), "-o", str(Path(d) / "k.o")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    usage = (int(regs[1]) if regs else None), (int(spills[1]) + int(spills[2]) if spills else 0)
    kept.parent.mkdir(parents=True, exist_ok=True)
    # whole files only, for concurrent censuses and for this one's ptxas threads: two kernels
    # with the same PTX ran ptxas at once here and shared one temporary file (FileNotFoundError)
    tmp = kept.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(usage))
    os.replace(tmp, kept)
    return usage


def unrounded(arith: dict[str, int]) -> int:
    """How many fp add/sub/mul of an `ARITH` count carry no rounding mode (``add.f32``, not
    ``add.rn.f32``): PTX lets ptxas fuse such a mul and add into one fma where its schedule puts
    them together, so their bits depend on code layout. LLVM writes ``.rn`` on every one when a
    kernel is compiled with ``enable_fp_fusion=False``."""
    rounded = {"rn", "rz", "rm", "rp"}
    return sum(
        n for a, n in arith.items()
        if a.split(".")[0] in ("add", "sub", "mul") and not rounded & set(a.split("."))
    )  # fmt: skip
