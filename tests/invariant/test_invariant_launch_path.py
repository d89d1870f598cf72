"""The batch-invariant kernels' host path (issue 47: the cost of exactness on a GPU is host time
on small models): after the first launch of a specialisation, each kernel is called through its
compiled launcher (`triton_launch.launch`), as the FP8 kernels are, with its settings built once.

Run on CPU tensors with the kernels replaced by labelled stand-ins (`triton_fakes.FakeJit`:
nothing is computed, the launches are recorded), since no compiled kernel can run here; what
the kernels compute is `test_invariant_kernels.py`'s business, and the GPU tests'. The ints a
batch sets are not specialised by Triton (each kernel's ``do_not_specialize``), so a decode step
and a prefill reach the same compiled kernel either way; `launch` keys on their size classes as
well, which costs one more first launch per class, never another kernel.
"""

from __future__ import annotations

import pytest
import torch
from triton_fakes import FakeJit, direct_launches_on

from nemo_jetrl.fp8 import triton_launch
from nemo_jetrl.invariant.kernels import attention, matmul, rows

pytest.importorskip("triton")

KERNELS = (
    (rows, "rms_rstd_kernel"), (rows, "logsumexp_kernel"), (matmul, "matmul_kernel"),
    (attention, "attention_kernel"),
)  # fmt: skip


@pytest.fixture
def launches(monkeypatch):  # type: ignore[no-untyped-def]
    if not triton_launch.interpreting():
        pytest.skip("emulates the CUDA path on CPU tensors; a GPU runs the real one")
    log: list = []
    for module, name in KERNELS:
        jit = module._jit()
        monkeypatch.setattr(jit, name, FakeJit(getattr(jit, name), log))
    direct_launches_on(monkeypatch)
    return log


def _calls(m: int) -> None:
    """One of each kernel, as a decode step (m = 1 row / query) or a prefill runs it."""
    x = torch.randn(m, 256).to(torch.bfloat16)
    rows.rms_rstd(x, 1e-6)
    rows.logsumexp_parts(torch.randn(m, 1000))
    matmul.matmul(x, torch.randn(384, 256).to(torch.bfloat16))
    q = torch.randn(1, 2, m, 64).to(torch.bfloat16)
    kv = torch.randn(1, 2, 37, 64).to(torch.bfloat16)
    attention.attention(q, kv, kv, None, 0.125)


def test_each_invariant_kernel_launches_directly_after_its_first_launch(launches):
    _calls(64)
    assert [e[0] for e in launches] == ["jit"] * 4  # the first launch of each: through Triton
    _calls(64)
    assert [e[0] for e in launches[4:]] == ["direct"] * 4
    # another prefill size of the same classes (% 16 == 0, not 1): the same launchers
    _calls(32)
    assert [e[0] for e in launches[8:]] == ["direct"] * 4
    # a decode step: the row kernels take the rows in their grid only (the same launchers); the
    # matmul's M and attention's query count of 1 are another size class for the key, launched
    # through Triton once (Triton compiles nothing new: it does not specialise those ints)
    _calls(1)
    _calls(1)
    assert [e[0] for e in launches[12:]] == ["direct", "direct", "jit", "jit"] + ["direct"] * 4
    # what a direct launch passes: the grid, then no launch-hook metadata
    grids = [e[1] for e in launches[4:8]]
    assert grids[0] == (64, 1, 1) and grids[2] == (1, 6, 1), grids


def test_the_settings_of_a_launch_are_built_once(launches):
    _calls(8)
    metas = (rows._meta(rows.ROW_BLOCK, torch.bfloat16), rows._meta(rows.ROW_BLOCK, torch.bfloat16))
    assert metas[0] is metas[1] and isinstance(metas[0], triton_launch.LaunchMeta)
    assert metas[0]["enable_reflect_ftz"] is False
    # attention's settings keep fp fusion off (its bits at every pipeline depth)
    infos = attention._meta.cache_info()
    assert infos.currsize >= 1
    for meta in [attention._meta(False, attention.ATTN_BLOCK_M, attention.ATTN_BLOCK_N, 64,
                                 False, True, 1)]:  # fmt: skip
        assert meta["enable_fp_fusion"] is False and meta["enable_reflect_ftz"] is False
