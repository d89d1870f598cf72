"""The grouped rows GEMM compiled for Hopper (sm_90) without a GPU: Triton's compiler in a subprocess
(TRITON_INTERPRET=0, ``GPUTarget("cuda", 90, 32)``), the way `tests/invariant` checks attention.

For each `grouped_tiles.ROWS_TILES` shape the kernel is compiled with the arguments a launch on
Qwen3-30B-A3B's experts passes (FP8 pointers on the tensor-core path; ints specialized as the
JIT does: 1 becomes a constant, multiples of 16 are marked divisible). Asserted: it compiles; its
shared memory fits Hopper's 227 KiB; the FP8 dot is ``wgmma`` (never ``mma.sync``, which rounds
otherwise) and the very same wgmma instruction in every shape (so the shape cannot change a
row's bits); the loads are pipelined (``cp.async``) straight into the MMA's shared-memory
operands (no ``local_load`` of an operand into registers and back), by TMA (``cp.async.bulk
.tensor``) in the shapes that ask for it. What it does not show: the time, the bits on a GPU
(bench_moe_layer checks both), and Triton 3.6's output (the GPU image's; here the installed one).
"""

from __future__ import annotations

import pytest

from nemo_jetrl.fp8 import grouped_tiles

pytestmark = [pytest.mark.triton, pytest.mark.slow]
HOPPER_SMEM = 232448  # bytes of shared memory one block may use on an H100/H200 (227 KiB)
WGMMA = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"

_SM90_COMPILE = """
import inspect, json, re, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nemo_jetrl.fp8 import _triton_grouped_gemm_jit as jit
from nemo_jetrl.fp8.grouped_tiles import ROWS_TILES
from nemo_jetrl.fp8.triton_launch import NO_FTZ

E, N, K, M = 128, 1536, 2048, 16384  # Qwen3-30B-A3B gate_up at 2048 tokens, top-8
PTRS = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*bf16", sa_ptr="*fp32", sb_ptr="*fp32",
            lut_a_ptr="*fp32", lut_b_ptr="*fp32", off_ptr="*i64", rows_ptr="*i64")
FPROP = dict(E=E, N=N, K=K, sam=K, sak=1, sbe=N * K, sbn=K, sbk=1, scm=N, scn=1, ssam=K // 128,
             ssak=1, ssbe=(N // 128) * (K // 128), ssbn=K // 128, ssbk=1)
# DGrad on the transposed view W.t() [E, K, N] of W [E, N, K] (out features K, reduced over N).
DGRAD = dict(FPROP, N=K, K=N, sam=N, ssam=N // 128, sbn=1, sbk=K, scm=K, ssbn=1, ssbk=K // 128)
out = []
for name, tile in ROWS_TILES.items():
    for case, ints, gather in (("gate_up", FPROP, True), ("down", FPROP, False),
                               ("dgrad", DGRAD, False)):
        params = list(inspect.signature(jit.grouped_rows_gemm_kernel.fn).parameters)
        sig, consts, attrs = {}, {}, {}
        consts.update(BM=tile.bm, BN=128, E_POW2=128, GATHER=gather, NATIVE=True, TF32=True,
                      FP8_A=tl.float8e5 if case == "dgrad" else tl.float8e4nv,
                      FP8_B=tl.float8e4nv, TMA_A=False, TMA_B=False)
        for i, p in enumerate(params):
            if p in consts:
                sig[p] = "constexpr"
            elif p in PTRS:
                sig[p] = PTRS[p]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif ints[p] == 1:  # the JIT's specialization of 1
                sig[p], consts[p] = "constexpr", 1
            else:
                sig[p] = "i32"
                if ints[p] % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        if case == "dgrad":
            sig["a_ptr"] = "*fp8e5"
        # TMA where the host makes a descriptor: the contiguous weights, an ungathered A.
        consts.update(TMA_A=tile.tma and not gather and case != "dgrad",
                      TMA_B=tile.tma and case != "dgrad")
        for p, rows in (("a_ptr", tile.bm), ("b_ptr", 128)):
            if consts["TMA_" + p[0].upper()]:
                sig[p] = f"tensordesc<fp8e4nv[{rows}, 128]>"
                attrs.pop((params.index(p),), None)
        kernel = triton.compile(
            ASTSource(fn=jit.grouped_rows_gemm_kernel, signature=sig, constexprs=consts,
                      attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_stages=tile.stages, **tile.options, **NO_FTZ),
        )
        ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
        out.append(dict(
            tile=name, case=case, shared=kernel.metadata.shared,
            wgmma=sorted(set(re.findall(r"wgmma\\.mma_async[\\w.]*", ptx))),
            mma_sync=ptx.count("mma.sync"), cp_async=ptx.count("cp.async.cg"),
            tma=ptx.count("cp.async.bulk.tensor"),
            local_load=ttgir.count("ttg.local_load"),
        ))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    from tests.sm90_compile import compile_report

    return compile_report(_SM90_COMPILE, timeout=600)  # type: ignore[return-value]


def test_every_tile_shape_compiles_for_sm90_within_hoppers_shared_memory(compiled):
    cases = [(r["tile"], r["case"]) for r in compiled]
    assert cases == [(t, c) for t in grouped_tiles.ROWS_TILES for c in ("gate_up", "down", "dgrad")]
    for r in compiled:
        assert 0 < r["shared"] <= HOPPER_SMEM, r


def test_the_fp8_dot_is_one_wgmma_instruction_in_every_shape(compiled):
    for r in compiled:
        fmt_a = "e5m2" if r["case"] == "dgrad" else "e4m3"
        assert r["wgmma"] == [WGMMA.replace("e4m3.e4m3", f"{fmt_a}.e4m3")], r
        assert r["mma_sync"] == 0, r


def test_operands_are_pipelined_into_shared_memory_for_the_mma(compiled):
    for r in compiled:
        tma = grouped_tiles.ROWS_TILES[r["tile"]].tma and r["case"] != "dgrad"
        assert (r["tma"] > 0) == tma, r  # TMA loads exactly where the shape asks for them
        # cp.async (the loads run ahead of the MMA, num_stages) for what TMA does not load
        assert (r["cp_async"] > 0) == (not tma or r["case"] == "gate_up"), r
        assert r["local_load"] == 0, r  # no operand through registers and back
