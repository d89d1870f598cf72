"""`scripts/sm90_ptx.py`, the sm_90 census's PTX readers: byte accesses counted as Triton 3.6
writes them, and ptxas's answers kept per PTX text (also when threads race to write one)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import sm90_ptx  # a script module (scripts/ is not a package)


def test_byte_accesses_are_counted_in_ptx():
    """The census's byte-access pattern on PTX lines as Triton 3.6 writes them: FP8 codes a byte
    (or two) at a time count, 16-byte vectors, 4-byte vectors of codes and bf16 scalars do not."""
    narrow = ("\t@%p3 st.global.b8 [ %rd5 + 0 ], { %rs1 };", "\tld.global.b8 %rs1, [%rd1];",
              "\t@!%p2 ld.global.L1::evict_last.v2.b8 { %rs1, %rs2 }, [ %rd2 + 0 ];",
              "\tst.global.u8 [%rd1], %rs1;")  # fmt: skip
    wide = ("\t@%p1 st.global.v4.b32 [ %rd5 + 0 ], { %r1, %r2, %r3, %r4 };",
            "\tld.global.v4.b8 { %rs1, %rs2, %rs3, %rs4 }, [ %rd2 + 0 ];",
            "\tld.global.b16 %rs1, [%rd1];", "\tld.shared.b8 %rs1, [%r1];")  # fmt: skip
    found = sm90_ptx.BYTE_ACCESS
    assert [bool(found.search(t)) for t in narrow + wide] == [True] * 4 + [False] * 4
    assert len(found.findall("\n".join(narrow + wide))) == 4
    shared = sm90_ptx.SHARED_BYTE_ACCESS  # as Triton 3.6 writes the 128x1 transpose
    lines = ("\tst.shared.b8 [%r5+1024], %rs3;", "\t@%p1 ld.shared.b8 %rs1, [%r1];",
             "\tst.shared.b32 [%r5], %r7;", "\tst.shared.v4.b32 [%r2], {%r1, %r2, %r3, %r4};",
             "\tst.global.b8 [%rd1], %rs1;")  # fmt: skip
    assert [bool(shared.search(t)) for t in lines] == [True, True, False, False, False]


def test_l2_prefetches_are_counted_in_ptx():
    """The census's count of bulk L2 prefetches (the split-K `SPLIT_PREFETCH` variant's inline
    assembly, as Triton 3.6 prints it) against lines that only look alike."""
    lines = ("\t{ .reg .pred p; setp.ne.u32 p, %r21, 0; @p cp.async.bulk.prefetch.L2.global "
             "[%rd35], %r21; mov.u32 %r20, 0; }",
             "\tcp.async.bulk.prefetch.L2.global [%rd1], 1024;",
             "\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
             "[%r1], [%rd2, {%r3, %r4}], [%r5];",
             "\tprefetch.global.L2 [%rd7];", "\tcp.async.cg.shared.global [ %r9 + 0 ], [ %rd9 + 0 ], 16;")  # fmt: skip
    found = sm90_ptx.L2_PREFETCH
    assert [bool(found.search(t)) for t in lines] == [True, True, False, False, False]
    assert len(found.findall("\n".join(lines))) == 2


_TINY_PTX = """.version 8.0
.target sm_90a
.address_size 64
.visible .entry tiny(.param .u64 p)
{
  .reg .b64 %rd<2>;
  .reg .b32 %r<2>;
  ld.param.u64 %rd1, [p];
  mov.u32 %r1, VALUE;
  st.global.u32 [%rd1], %r1;
  ret;
}
"""


def test_ptxas_usage_is_kept_per_ptx_text_and_read_back(tmp_path, monkeypatch):
    """`sm90_ptx.ptxas_usage` runs this Triton's ptxas once per PTX text and reads its answer
    back after (a census over a warm Triton cache ran ptxas on every kernel again): a changed
    text runs it again, and what it reads is the kept file."""
    import subprocess

    usage = sm90_ptx.ptxas_usage
    monkeypatch.setenv(sm90_ptx.PTXAS_CACHE_VAR, str(tmp_path / "kept"))
    runs = []
    real_run = subprocess.run

    def counting_run(cmd, *a, **k):
        if "-v" in cmd:  # a compile (`--version`, Triton's own query, is not one)
            runs.append(cmd[0])
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(subprocess, "run", counting_run)
    first = usage(_TINY_PTX.replace("VALUE", "7"))
    assert first[0] is not None and first[0] > 0 and first[1] == 0 and len(runs) == 1, (first, runs)
    assert usage(_TINY_PTX.replace("VALUE", "7")) == first and len(runs) == 1
    usage(_TINY_PTX.replace("VALUE", "9"))  # another text: ptxas again
    assert len(runs) == 2
    kept = sorted((tmp_path / "kept").glob("*.json"))
    assert len(kept) == 2
    for f in kept:  # planted answers are what a warm run returns
        f.write_text("[201, 64]")
    assert usage(_TINY_PTX.replace("VALUE", "7")) == (201, 64) and len(runs) == 2
    assert usage(None) == (None, None)


def test_ptxas_usage_of_one_text_on_many_threads_at_once(tmp_path, monkeypatch):
    """The census runs ptxas on a thread pool, and two kernels can share one PTX text: threads
    that run it at once each keep a whole file (they shared one temporary name, and the second
    `os.replace` raised FileNotFoundError on a cold cache)."""
    from concurrent.futures import ThreadPoolExecutor

    for attempt in range(6):  # a cold cache each time: the threads race to write one answer
        kept = tmp_path / f"kept{attempt}"
        monkeypatch.setenv(sm90_ptx.PTXAS_CACHE_VAR, str(kept))
        with ThreadPoolExecutor(8) as pool:
            texts = [_TINY_PTX.replace("VALUE", "5")] * 8
            got = list(pool.map(sm90_ptx.ptxas_usage, texts))
        assert len(set(got)) == 1 and got[0][0] is not None and got[0][0] > 0, got
        assert [f.suffix for f in kept.iterdir()] == [".json"]
