"""`scripts/sm90_census.py`: every Triton kernel the GPU paths launch compiles for Hopper (sm_90)
with this machine's Triton and with the GPU image's (3.6.0, `.venv-triton-gpu`, made by
scripts/setup_env.sh), within Hopper's shared memory, on wgmma, one instruction at every batch
size for the batch-invariant kernels. And the census's checks can fail (planted rows)."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU_TRITON_DIR = Path(os.environ.get("JETRL_GPU_TRITON_DIR", REPO / ".venv-triton-gpu"))
GPU_IMAGE_TRITON = "3.6.0"  # the lent H100/H200 image's (benchmarks/gpu/results, runs 4-6)
HOPPER_SMEM = 232448  # bytes of shared memory one block may use on an H100/H200 (H100 log)
FP8_WGMMA = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"
BF16_WGMMA_64 = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"
HOST_MODULES = (  # the modules whose host code chooses the census's tiles and launches
    "nemo_jetrl.fp8.triton_kernels", "nemo_jetrl.fp8.rowcol_quantize", "nemo_jetrl.fp8.triton_gemm",
    "nemo_jetrl.fp8.triton_split", "nemo_jetrl.fp8.triton_grouped", "nemo_jetrl.fp8.grouped_tiles",
    "nemo_jetrl.invariant.kernels.rows", "nemo_jetrl.invariant.kernels.matmul",
    "nemo_jetrl.invariant.kernels.attention", "nemo_jetrl.invariant.kernels._jit_matmul",
    "nemo_jetrl.invariant.kernels._jit_attention", "nemo_jetrl.fp8._triton_split_jit",
    "nemo_jetrl.fp8._triton_grouped_jit", "nemo_jetrl.fp8._triton_grouped_gemm_jit",
)  # fmt: skip


def _census_module():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import sm90_census
    finally:
        sys.path.pop(0)
    return sm90_census


def _package_kernels() -> set[str]:
    """Every ``@triton.jit`` function named ``*_kernel`` in the package (its launch entry points)."""
    names = set()
    for path in (REPO / "nemo_jetrl").rglob("*.py"):
        names |= set(
            re.findall(r"@triton\.jit(?:\([^)]*\))?\s*\ndef (\w+_kernel)\(", path.read_text())
        )
    return names


def _gpu_triton_dir() -> Path:
    if not (GPU_TRITON_DIR / "triton" / "__init__.py").is_file():
        pytest.fail(
            f"the GPU image's Triton is not under {GPU_TRITON_DIR}: run scripts/setup_env.sh "
            f"(`.venv/bin/pip install --no-deps --target .venv-triton-gpu "
            f"triton=={GPU_IMAGE_TRITON}`)"
        )
    return GPU_TRITON_DIR


def _run_census(tmp_path: Path, triton_dir: Path | None, *extra: str, cache: Path | None = None):  # type: ignore[no-untyped-def]
    """(report, process) of scripts/sm90_census.py in its own process, with ``triton_dir``'s
    Triton first on the path (None: the installed one) and ``extra`` arguments."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([*([str(triton_dir)] if triton_dir else []), str(REPO)])
    if cache is not None:
        env["TRITON_CACHE_DIR"] = str(cache)
    out = tmp_path / "census.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "sm90_census.py"), "--json", str(out), *extra],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc


@pytest.fixture(scope="module", params=["installed", "gpu_image"])
def census(request, tmp_path_factory) -> dict:  # type: ignore[no-untyped-def]
    """The census with each Triton; the GPU image's also packs the cache a GPU call carries
    (`--pack-cache`: a fresh cache, so every kernel is compiled and checked)."""
    here = {name: importlib.import_module(name).__file__ for name in HOST_MODULES}
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "gpu_image":
        packed = ("--pack-cache", str(tmp / "cache.tar.gz"), "--cache-root", str(tmp / "unpacked"))
        report, proc = _run_census(tmp, _gpu_triton_dir(), *packed)
        report["tmp"] = tmp
    else:
        report, proc = _run_census(tmp, None)
    report.update(rc=proc.returncode, stdout=proc.stdout, here=here, which=request.param)
    return report


pytestmark = [pytest.mark.triton]


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_with_no_problem(census):
    """~1.5 min per Triton on 2 cores with an empty cache: ~550 launches, ~90 specializations."""
    if census["which"] == "gpu_image":
        assert census["triton"] == GPU_IMAGE_TRITON
    assert census["problems"] == [] and census["rc"] == 0, census["stdout"][-3000:]
    rows = census["rows"]
    assert all("error" not in r for r in rows)
    # every launch entry point of the package is in the census (a new kernel needs a workload)
    assert {r["kernel"] for r in rows} == _package_kernels()
    # it compiled this checkout's code: each host module it ran is the file imported here
    assert {n: census["sources"][n] for n in HOST_MODULES} == census["here"]
    assert census["launches"] >= 540 and len(rows) >= 89
    assert max(r["shared"] for r in rows) <= HOPPER_SMEM


@pytest.mark.slow
def test_attention_shared_memory_is_within_the_stage_rules_estimate(census):
    """Every attention launch of the census (bf16 at head_dim 64, 128 and 256, fp32 at 64 and
    128) runs at the stage rule's stages, and the shared memory Triton allocates for sm_90 is
    within the rule's estimate, itself within Hopper's: the estimate is what `attention_stages`
    decides by, and one below the real figure would let a launch fail on the GPU. fp32 at 256,
    which no GPU path launches and the rule gives one stage, is compiled by
    tests/invariant/test_invariant_kernels.py."""
    from nemo_jetrl.invariant.kernels import attention as ka

    seen = set()
    for r in census["rows"]:
        if r["kernel"] != "attention_kernel":
            continue
        d, size, stages = (
            r["consts"]["BD"],
            4 if r["consts"]["IEEE"] else 2,
            r["options"]["num_stages"],
        )
        assert stages == ka.attention_stages(d, size), (d, size, stages)
        assert 0 < r["shared"] <= ka.attention_smem_bytes(d, size, stages) <= HOPPER_SMEM, (d, size)
        seen.add((d, size))
    assert seen == {(64, 2), (128, 2), (256, 2), (64, 4), (128, 4)}, seen


@pytest.mark.slow
def test_the_measured_instructions_of_the_gpu_paths(census):
    """Facts of this census (both Tritons, 2026-11-29), stated as literals: the FP8 GEMMs of both
    training and serving multiply on one m64n128k32 e4m3 wgmma (the weight's 64 rows in M); the
    invariant matmul on one m64n64k16 bf16 wgmma at M = 1, 3, 64, 512; bf16 attention at
    head_dim 256 takes 180224 B of shared memory (its 2 stages: 227 KiB is the limit); attention's
    only fmas are its FMA dot's (fp32), none in bf16."""
    rows = census["rows"]

    def mmas(kernel: str, **consts: object) -> set[tuple]:
        return {
            tuple(r["mma"]) for r in rows
            if r["kernel"] == kernel and all(r["consts"].get(k) == v for k, v in consts.items())
        }  # fmt: skip

    for kernel in ("block_fp8_gemm_kernel", "grouped_rows_gemm_kernel"):
        assert mmas(kernel) == {(FP8_WGMMA,)}, kernel
    assert mmas("matmul_kernel", IEEE=False) == {(BF16_WGMMA_64,)}
    assert mmas("matmul_kernel", IEEE=True) == {()}  # IEEE fp32 products: no tensor cores
    attention = [r for r in rows if r["kernel"] == "attention_kernel"]
    d256 = [r for r in attention if r["consts"]["BD"] == 256]
    assert {r["shared"] for r in d256} == {180224}
    # attention without fp fusion: no fma in bf16 (both dots on wgmma) and in fp32 exactly the FMA
    # dots' (BM x BN x BD products each, over 128 threads); with fusion, LLVM added some
    for r in attention:
        fmas, bd = r["arith"].get("fma.rn.f32", 0), r["consts"]["BD"]
        assert fmas == (2 * 64 * 64 * bd // 128 if r["consts"]["IEEE"] else 0), (bd, fmas)
    # the serving GEMMs keep their accumulators in registers (ptxas for sm_90a): no spill in the
    # split-K kernel at any token tile (128 tokens spilled 1260 bytes: PREFILL_TOKEN_TILE = 64)
    split = [r for r in rows if r["kernel"] == "split_gemm_kernel"]
    assert {r["consts"]["BT"] for r in split} == {16, 32, 64}
    assert all(r["spill_bytes"] == 0 and r["registers"] <= 255 for r in split), split
    # with the GPU call's launch variants (`bench_serving_kernel.SPLIT_SWEEP`): a deeper and a
    # shallower pipeline, the quantization fused at the default sizes and at none, the weight
    # through TMA descriptors (the TMA unit's bulk copies, fewer registers: 56 against 74 at
    # M <= 16 with Triton 3.6), the weight chunk prefetched into L2 (split mode: every decode tile)
    assert {r["options"]["num_stages"] for r in split} == {2, 3, 4}
    assert {r["consts"]["BT"] for r in split if r["consts"]["FUSED"]} == {16}  # FUSE_MAX_M
    assert {r["consts"]["BT"] for r in split if not r["consts"]["FUSED"]} == {16, 32, 64}
    tma = [r for r in split if r["consts"]["TMA_W"]]
    assert {r["consts"]["BT"] for r in tma} == {16, 32, 64} and all(r["tma_copies"] for r in tma)
    assert not any(r["tma_copies"] for r in split if not r["consts"]["TMA_W"])
    pf = [r for r in split if r["consts"].get("PREFETCH")]
    assert {r["consts"]["BT"] for r in pf} == {16, 32, 64} and all(r["consts"]["SPLIT"] for r in pf)
    assert all(r["l2_prefetches"] for r in pf), pf
    assert not any(r.get("l2_prefetches") for r in rows if r not in pf)
    # two warpgroups a decode program (128 weight rows in split mode, the sweep's `wg2`)
    wg2 = [r for r in split if r["consts"]["SPLIT"] and r["consts"]["BW"] == 128]
    assert {r["consts"]["BT"] for r in wg2} == {16, 32, 64}
    assert all(r["options"]["num_warps"] == 8 for r in wg2), wg2
    # launched as programmatic dependent launches (alone and after the prefetch): the launch
    # option and the kernel's wait for the kernel before it, together, nowhere else
    pdl = [r for r in split if r["consts"].get("PDL")]
    assert {r["consts"]["BT"] for r in pdl} == {16, 32, 64}
    assert {bool(r["consts"].get("PREFETCH")) for r in pdl} == {True, False}
    assert all(r["options"].get("launch_pdl") and r["pdl_waits"] for r in pdl), pdl
    assert not any(
        r.get("pdl_waits") or r["options"].get("launch_pdl") for r in rows if r not in pdl
    )
    # the fused rowcol quantizer (2026-11-30, both Tritons): a whole 128 x 128 tile in registers
    # at 8 warps takes 249 (3.6) / 255 (3.9) registers a thread, one program per SM, its load not
    # pipelined; 32-row chunks take at most 128 (two programs per SM: 2 x 256 x 128 = the SM's
    # 65536) and load by cp.async, and were still slower on the H200 (24% of a copy's bandwidth
    # against 34%, run 8), so the whole tile is the default again
    rowcol: dict[tuple, list] = {}
    for r in rows:
        if r["kernel"] == "quantize_rowcol_kernel":
            key = (r["consts"]["CHUNK"], r["consts"]["STAGES"], r["options"]["num_warps"])
            rowcol.setdefault(key, []).append(r)
    whole, chunked = rowcol[(128, 1, 8)], rowcol[(32, 2, 8)]
    assert all(r["registers"] >= 249 and r["async_copies"] == 0 for r in whole), whole
    assert all(r["registers"] <= 128 and r["async_copies"] > 0 for r in chunked), chunked
    # the default is what the training linear launches
    assert any("training_quantizers" in r["workloads"] for r in whole)
    # the 128x1 quantizer (2026-11-30): a whole 128 x 64 tile takes 115-138 registers (Triton
    # 3.6; 112-140 with 3.9, by specialization); 32-row chunks at most 76 (both), loaded by
    # cp.async, yet at 34% of a copy's bandwidth against the whole tile's 58% (H200, run 8)
    cols = [r for r in rows if r["kernel"] == "quantize_kernel" and r["consts"]["MODE"] == 2]
    chunked = [r for r in cols if r["consts"]["CHUNK"] == 32 and r["consts"]["TK"] == 64]
    whole64 = [r for r in cols if r["consts"]["CHUNK"] == 128 and r["consts"]["TK"] == 64]
    assert all(r["registers"] <= 76 and r["async_copies"] > 0 for r in chunked), chunked
    assert all(r["registers"] >= 112 and r["async_copies"] == 0 for r in whole64), whole64
    assert any("training_quantizers" in r["workloads"] for r in whole64)
    # the batch sizes the invariant matmul was launched at (M = 1 is a JIT constant)
    ms = {m for r in rows if r["kernel"] == "matmul_kernel" for m in r["ints"]["M"]}
    assert {1, 3, 64, 512} <= ms
    # the MoE step's grouped GEMM as the GPU call launches it: the three models' expert counts
    # (E_POW2 64 Moonlight-16B-A3B, 128 Qwen3-30B-A3B, 256 DeepSeek-V3), and the tile sweep's
    # shapes (rows BM, TMA operands) at the prefill models
    grouped = [r for r in rows if r["kernel"] == "grouped_rows_gemm_kernel"]
    serving = [r for r in grouped if "experts" in r["workloads"]]
    assert {r["consts"]["E_POW2"] for r in serving} == {64, 128, 256}
    swept = {(r["consts"]["BM"], r["consts"]["TMA_B"], r["consts"]["E_POW2"])
             for r in grouped if "experts_tiles" in r["workloads"]}  # fmt: skip
    assert swept == {(bm, tma, e) for bm in (64, 128) for tma in (False, True) for e in (128, 256)}


def test_the_checks_fail_on_planted_rows():
    """Each check of `problems` on a row made to fail it, beside a row that passes."""
    census = _census_module()
    ok = {"kernel": "matmul_kernel", "workloads": ["w"], "consts": {"IEEE": False, "BM": 64},
          "options": {"num_warps": 4}, "ints": {}, "shared": 32768, "mma": [BF16_WGMMA_64],
          "arith": {BF16_WGMMA_64: 4}, "dtypes": ["bfloat16", "bfloat16", "float32"]}  # fmt: skip
    assert census.problems([ok]) == []
    big = dict(ok, shared=HOPPER_SMEM + 1)
    sync = dict(ok, mma=["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"])
    broken = dict(ok, error="CompilationError: at 3:4: ...")
    other_tile = dict(ok, consts={"IEEE": False, "BM": 16})  # a tile chosen from M
    fp32 = ["float32"] * 3
    other_dtype = dict(ok, consts={"IEEE": True, "BM": 64}, mma=[], dtypes=fp32)  # not the batch
    tf32_at_m1 = dict(ok, consts={"IEEE": False, "BM": 64}, dtypes=fp32)  # fp32 on TF32 at M = 1
    other_arith = dict(ok, arith={BF16_WGMMA_64: 4, "fma.rn.f32": 64})  # e.g. an M == 1 epilogue
    # the same code, but two binaries: M specialised (== 1, % 16) where one must serve every M
    at_m1, at_m64 = dict(ok, ints={"M": [1], "K": [256]}), dict(ok, ints={"M": [64], "K": [256]})
    other_k = dict(ok, ints={"M": [64], "K": [200]})  # another weight's K: another binary, fine
    assert len(census.problems([big])) == 1 and "shared memory" in census.problems([big])[0]
    assert "mma.sync" in census.problems([sync])[0]
    assert census.problems([broken])[0].startswith("does not compile: matmul_kernel")
    assert "differ across batch sizes" in census.problems([ok, other_tile])[0]
    assert census.problems([ok, other_dtype]) == []
    assert "differ across batch sizes" in census.problems([other_dtype, tf32_at_m1])[0]
    assert "differ across batch sizes" in census.problems([ok, other_arith])[0]
    (two,) = census.problems([at_m1, at_m64])
    assert "2 compiled kernels at its batch sizes, not one (specialised on ['M']" in two, two
    assert census.problems([dict(at_m1, batch_args=["M"]), other_k]) == []
    spills = dict(ok, registers=255, spill_bytes=1260)
    assert "1260 bytes of register spills (255 registers)" in census.problems([spills])[0]
    fp32_attention = dict(spills, kernel="attention_kernel", consts={"IEEE": True, "BD": 64},
                          options={"num_warps": 4, "enable_fp_fusion": False})  # fmt: skip
    assert census.known_spill(fp32_attention) and census.problems([fp32_attention]) == []
    rowcol16 = dict(spills, kernel="quantize_rowcol_kernel", consts={"POW2": True},
                    options={"num_warps": 16}, spill_bytes=72)  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:  # accepted where only Triton 3.9 spills
        mp.setattr(census_triton(), "__version__", "3.9.0")
        assert census.known_spill(rowcol16) and census.problems([rowcol16]) == []
        mp.setattr(census_triton(), "__version__", "3.6.0")
        assert "72 bytes of register spills" in census.problems([rowcol16])[0]
        assert census.known_spill(dict(rowcol16, options={"num_warps": 8})) is None
    # the attention kernel launched without fp fusion: every add/sub/mul has its rounding (.rn)
    attn = dict(ok, kernel="attention_kernel", consts={"IEEE": False, "BD": 64},
                options={"num_warps": 4, "enable_fp_fusion": False},
                arith={BF16_WGMMA_64: 8, "mul.rn.f32": 32, "add.rn.f32": 32})  # fmt: skip
    assert census.problems([attn]) == []
    fused = dict(attn, options={"num_warps": 4})  # Triton's default: fusion on
    loose = dict(attn, arith={BF16_WGMMA_64: 8, "mul.f32": 30, "add.rn.f32": 32, "fma.rn.f32": 2})
    assert "(enable_fp_fusion not False, or 0 add/sub/mul" in census.problems([fused])[0]
    assert "or 30 add/sub/mul without a rounding mode" in census.problems([loose])[0]
    assert census.sm90_ptx.unrounded({"sub.f32": 3, "mul.ftz.f32": 2, "sub.rz.f32": 5}) == 5
    bytewise = dict(ok, kernel="quantize_tokens_kernel", byte_accesses=32)
    assert "32 global loads/stores of one or two bytes" in census.problems([bytewise])[0]
    # the packed-word 128x1 kernel moves words through shared memory; the others may move bytes
    packed = dict(ok, kernel="quantize_kernel", consts={"MODE": 2, "PACK": True},
                  shared_byte_accesses=64)  # fmt: skip
    assert "64 shared-memory byte accesses in a packed-word kernel" in census.problems([packed])[0]
    assert census.problems([dict(packed, consts={"MODE": 2, "PACK": False})]) == []


def census_triton():
    import triton

    return triton


@pytest.mark.slow
def test_the_packed_cache_serves_every_kernel_under_the_images_key(census):
    """What `device_session.sh --prepare` carries to a GPU call: the census compiled under the
    GPU image's cache key (Triton 3.6.0, its cp312 libtriton's hash), packed binary-only with
    its index pointing where it is unpacked. Unpacked as the device unpacks it
    (`census_cache.py unpack`, a fresh process) by this machine's 3.6.0, whose libtriton is
    another build (cp311): re-keyed, and a census in a fresh process under this Triton's own key
    reads every kernel from it: nothing is compiled (no new cache entry, no PTX, which only a
    compile writes). The GPU image takes the same path when its Triton is not PyPI's build."""
    import tarfile

    if census["which"] != "gpu_image":
        return  # packed from the GPU image's census only (the fixture's other parameter)
    tmp = census["tmp"]
    root = tmp / "unpacked"
    assert census["rc"] == 0, census["stdout"][-3000:]
    with tarfile.open(tmp / "cache.tar.gz") as tar:
        names = tar.getnames()
        packed = json.load(tar.extractfile("./CENSUS.json"))
    assert packed["kernels"] == len(census["rows"]) == len(packed["tails"])
    assert packed["triton"] == GPU_IMAGE_TRITON and packed["root"] == str(root)
    assert {Path(n).suffix for n in names if n.count("/") == 2} == {".json", ".cubin"}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(_gpu_triton_dir())
    unpack = [sys.executable, str(REPO / "scripts" / "census_cache.py"), "unpack"]
    line = subprocess.run(
        [*unpack, str(tmp / "cache.tar.gz"), str(root)], env=env, capture_output=True, text=True
    ).stdout  # fmt: skip
    n = packed["kernels"]
    assert f"(re-keyed: another build of Triton 3.6.0, the same Python sources and ptxas; {n} " \
        "kernels filed under this image's key: expect hits)" in line, line  # fmt: skip
    entries = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert len(entries) == n and not set(entries) & set(packed["tails"])  # all filed anew
    (tmp / "replay").mkdir()
    replay, proc = _run_census(tmp / "replay", _gpu_triton_dir(), cache=root)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == entries  # nothing compiled
    assert len(replay["rows"]) == n
    assert all(r["mma"] is None for r in replay["rows"])  # every one read back, binary only
    assert proc.returncode == 1  # the census itself needs PTX: it says so, per kernel
