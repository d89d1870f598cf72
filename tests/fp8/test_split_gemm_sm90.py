"""The ``triton_splitk`` GEMM (`triton_split`) compiled for sm_90 on CPU: every launch mode's
MMA instruction, pipelined loads, shared memory, the split mode's one-launch fold, where the
L2-prefetch variant issues its prefetches and where the programmatic-dependent-launch variant
waits for the kernel before it (the bits: `test_split_gemm.py`)."""

from __future__ import annotations

import pytest
from triton_setup import TRITON_MARKS

pytest.importorskip("nemo_jetrl.fp8.triton_split")
pytestmark = TRITON_MARKS


# ------------------------------------------------------------------- compiled for sm_90

# Compiles, for sm_90 with this machine's Triton (no GPU needed), exactly the launches the host
# code makes (recorded from split_linear / split_gemm on CPU tensors), specialised as Triton's JIT
# specialises them (16-byte aligned pointers and multiples of 16, ints equal to 1), the host code
# told what an H100 is told (the FP8 tensor-core dot, the hardware cast), and prints what the
# GPU would run.
_SM90_COMPILE = r"""
import json, re
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nemo_jetrl.fp8 import quantize_blockwise, triton_gemm, triton_kernels, triton_split
from nemo_jetrl.fp8.triton_launch import NO_FTZ

calls = []
triton_split.launch = lambda kernel, grid, args, meta: calls.append((kernel, args, dict(meta)))
triton_gemm.launch = triton_split.launch
# what an H100 decides: the FP8 tensor-core dot and the hardware cast (here: the CPU's choices)
triton_split._dot_mode = lambda fmts, device: triton_split._kernel().DOT_NATIVE.value
triton_gemm._native = lambda a, b: True
triton_split._pdl_capable = lambda device: True  # sm_90: programmatic dependent launch
triton_kernels.resolve_native_cast = lambda x, native_cast: True
TYPES = {torch.uint8: "*u8", torch.int16: "*i16", torch.int32: "*i32", torch.float32: "*fp32", torch.bfloat16: "*bf16",
         torch.float8_e4m3fn: "*fp8e4nv"}

def compile_sm90(kernel, args, meta):
    sig, consts, attrs = {}, {}, {}
    for i, (name, a) in enumerate(zip(kernel.arg_names, args)):
        if isinstance(a, torch.Tensor):
            sig[name] = TYPES[a.dtype]
            aligned = a.data_ptr() % 16 == 0
        elif a == 1:
            sig[name], consts[name], aligned = "constexpr", 1, False
        else:
            sig[name], aligned = ("i32" if -2**31 <= a < 2**31 else "i64"), a % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    opts = {k: meta.pop(k) for k in ("num_warps", "num_stages", "launch_pdl", *NO_FTZ) if k in meta}
    for name, v in meta.items():
        sig[name], consts[name] = "constexpr", v
    k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = k.asm["ptx"]
    return dict(kernel=kernel.__name__, bt=consts.get("BT"), bw=consts.get("BW"),
                fused=consts.get("FUSED"), warps=opts["num_warps"],
                shared=k.metadata.shared,
                wgmma=sorted(set(re.findall(r"wgmma\.mma_async\S*", ptx))),
                mma_sync=len(re.findall(r"mma\.sync", ptx)),
                cp_async=len(re.findall(r"cp\.async\.(?:cg|ca)", ptx)),
                a_from_registers=bool(re.search(r"wgmma\.mma_async\S* \{[^}]*\}, \{", ptx)),
                split=consts.get("SPLIT"), prefetch=consts.get("PREFETCH"),
                l2_prefetches=len(re.findall(r"cp\.async\.bulk\.prefetch\.L2\.global", ptx)),
                prefetch_first=0 <= ptx.find("cp.async.bulk.prefetch") < ptx.find("cp.async.cg"),
                launch_pdl=k.metadata.launch_pdl, pdl=consts.get("PDL"), **pdl_order(ptx),
                **fold_protocol(ptx))

def pdl_order(ptx):
    # what a dependent launch may do before the previous kernel's writes are visible: only the
    # prefetch; the first load (cp.async or ld.global), store and atomic come after the wait; the
    # next launch is let go after the last MMA, before the partials or the output are stored
    body = ptx[ptx.find("{", ptx.find(".entry")):]
    wait, go = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
    first = min([i for i in (body.find(op) for op in ("cp.async.cg", "cp.async.ca", "ld.global",
                 "st.global", "atom.global")) if i >= 0])
    return dict(waits=body.count("griddepcontrol.wait"),
                gos=body.count("griddepcontrol.launch_dependents"),
                wait_first=0 <= wait < first and body.rfind("cp.async.bulk.prefetch", 0, wait)
                == body.rfind("cp.async.bulk.prefetch"),
                go_after_mma=go > body.rfind("wgmma.mma_async") and go < body.find("st.global"))

def fold_protocol(ptx):
    # split mode's handshake: partials stored, a barrier, then one acq_rel count at gpu scope;
    # the folder reads the partials from L2 (.cg)
    i = ptx.find("atom.global.gpu.acq_rel.add")
    return dict(counts=len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)),
                barrier_first=i > 0 and "bar.sync" in ptx[ptx.rfind("st.global", 0, i):i],
                l2_loads=len(re.findall(r"ld\.global\.cg", ptx)))

g = torch.Generator().manual_seed(0)
w = quantize_blockwise((torch.randn(4096, 4096, generator=g) * 0.05).bfloat16(), (128, 128))
x = torch.randn(256, 4096, generator=g).bfloat16()
triton_split.split_linear(x[:1], w, pow2_scales=True)               # split, fused quantization
triton_split.split_gemm(quantize_blockwise(x[:64], (1, 128)), w)    # split
triton_split.split_gemm(quantize_blockwise(x, (1, 128)), w)         # fold in registers
triton_gemm.block_fp8_gemm_triton(quantize_blockwise(x[:1], (1, 128)), w)  # the triton backend
triton_split.SPLIT_PREFETCH = True  # the sweep's L2-prefetch variant: split mode only
triton_split.split_linear(x[:1], w, pow2_scales=True)
triton_split.split_gemm(quantize_blockwise(x, (1, 128)), w)
triton_split.SPLIT_PDL = True  # then as programmatic dependent launches, with and without it
triton_split.split_linear(x[:1], w, pow2_scales=True)
triton_split.SPLIT_PREFETCH = False
triton_split.split_gemm(quantize_blockwise(x[:64], (1, 128)), w)
triton_split.split_gemm(quantize_blockwise(x, (1, 128)), w)
print(json.dumps([compile_sm90(*c) for c in calls]))
"""


@pytest.mark.slow
def test_every_mode_compiles_for_sm90_to_one_wgmma_family_with_pipelined_loads():
    """(The ``triton`` backend's dense kernel too.) Hopper rounds inside an FP8 MMA, and a 16-row mma.sync rounds unlike a 64-row wgmma (an
    H100 run saw it: results/README.md): every mode and token tile must compile to wgmma
    m64nXk32 e4m3 (the weight in the 64 rows), never mma.sync, within Hopper's shared memory; and
    the operand loads must be software-pipelined (cp.async) into the shared memory wgmma reads
    (FP8-typed pointers: uint8 codes went shared -> registers -> bitcast), or a decode GEMM waits
    on every load instead of streaming the weight."""
    from tests.sm90_compile import compile_report

    compiled = compile_report(_SM90_COMPILE, timeout=600)
    gemms = [c for c in compiled if c["kernel"] == "split_gemm_kernel"]
    (dense,) = [c for c in compiled if c["kernel"] == "block_fp8_gemm_kernel"]
    want = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"  # the triton backend, M = 1
    assert dense["wgmma"] == [want] and dense["cp_async"] > 0 and not dense["a_from_registers"]
    # decode: one warpgroup on 64 weight rows; above 64 tokens two, each on its own 64 rows
    # (then `SPLIT_PREFETCH` set, which only split mode takes; then `SPLIT_PDL` with and
    # without it)
    assert [(c["bt"], c["fused"], c["bw"], c["warps"]) for c in gemms] == [
        (16, True, 64, 4), (64, False, 64, 4), (64, False, 128, 8), (16, True, 64, 4),
        (64, False, 128, 8), (16, True, 64, 4), (64, False, 64, 4), (64, False, 128, 8)
    ]  # fmt: skip
    assert {c["kernel"] for c in compiled} == {"split_gemm_kernel", "block_fp8_gemm_kernel"}
    # one launch in split mode: the tile's last program folds after the handshake
    split = [(True, 1, True), (True, 1, True), (False, 0, False)]
    assert [(c["split"], c["counts"], c["barrier_first"]) for c in gemms] == [
        *split, (True, 1, True), (False, 0, False), *split
    ]  # fmt: skip
    # the L2 prefetch: issued before the K loop's first copy, in the split program it was asked
    # of, nowhere else (a bulk prefetch per row: 64 rows, at least one instruction)
    no = (False, False, False)
    assert [(c["prefetch"], c["l2_prefetches"] > 0, c["prefetch_first"]) for c in gemms] == [
        no, no, no, (True, True, True), no, (True, True, True), no, no
    ]  # fmt: skip
    # a programmatic dependent launch: launched as one (the compiled kernel's launch_pdl), one
    # wait before any load, store or atomic (only the prefetch before it: a write of the kernel
    # before, or into memory it still reads, is never touched early), the next launch let go
    # after the last MMA and before the first store, in both modes; none elsewhere
    pdl = [(c["pdl"], c["launch_pdl"], c["waits"], c["gos"], c["wait_first"], c["go_after_mma"])
           for c in gemms]  # fmt: skip
    assert pdl == [(False, False, 0, 0, False, False)] * 5 + [(True, True, 1, 1, True, True)] * 3
    assert not dense["launch_pdl"] and dense["waits"] == 0
    assert all(c["l2_loads"] > 0 for c in gemms if c["split"])
    for c in gemms:
        want = f"wgmma.mma_async.sync.aligned.m64n{c['bt']}k32.f32.e4m3.e4m3"
        assert c["wgmma"] == [want] and c["mma_sync"] == 0, c
        assert c["cp_async"] > 0 and not c["a_from_registers"], c  # both operands from smem
        assert 0 < c["shared"] <= 232448, c  # Hopper's limit as Triton states it (H100 log)
