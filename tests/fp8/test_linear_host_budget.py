"""The training FP8 linear's host work per call, held as counts (issue 48, point 5).

An H100 run (benchmarks/gpu/results/README.md, run 6) enqueued one `Fp8BlockLinear` fwd+bwd at
8192 tokens in 2.1-2.3 ms of host time against 0.9-1.3 ms of GPU work. Wall time cannot be
tested here, so this holds what the host does per call as counts, on the layer's CUDA path run
on CPU tensors (as on an H100: the Triton quantizers, two passes or fused, cuBLASLt
``scaled_mm`` GEMMs with MN-major scales, the FP8 weight cached, non-finite input flagged on
the device):

* frames: Python function calls (``sys.setprofile`` 'call' events) in `nemo_jetrl` code, the
  GEMM runner of `gemm_backends` included; torch's own frames (autograd, nn.Module) are counted
  and shown but not held (they change with torch, not with this code);
* device launches: Triton kernel launches plus the aten ops that would run a kernel on a GPU
  (a `TorchDispatchMode`; a GEMM counts one);
* allocations: aten ops returning a new tensor; and the other (view/metadata) aten ops, each a
  host dispatch.

The Triton kernels and ``F.scaled_mm`` are stand-ins here (`triton_fakes.FakeJit`, `_fake_scaled_mm`): they
record the launch and write nothing, so only the host path is counted (the kernels' bits are
the other tests' business). The Triton launches take `triton_launch.launch`'s direct path (the
compiled kernel's launcher, as on a GPU); the first launch of each specialisation goes through
the kernel's ``[grid]`` call (JITFunction.run) and is not counted (warm-up).

Counts differ from a GPU run in one known place: on CPU tensors the quantizer's device check
runs (`rowcol_quantize._refuse`: 4 frames, ``interpreting()`` reads the environment), which a
CUDA tensor skips. Adding a frame, launch or allocation fails these tests: update the literal
with the reason.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from triton_fakes import FakeJit, direct_launches_on
from triton_setup import TRITON_MARKS

import nemo_jetrl
from nemo_jetrl.fp8 import _triton_jit, finite_flags, linear, linear_plan, triton_launch
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.gemm_backends import GemmPlan
from nemo_jetrl.fp8.linear import Fp8BlockLinear
from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

pytestmark = TRITON_MARKS
PACKAGE = str(Path(nemo_jetrl.__file__).parent)
_ALLOCATING_NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


class _Ops(TorchDispatchMode):
    """Counts aten ops: launches (would run a kernel), allocations (a new tensor), views."""

    def __init__(self) -> None:
        super().__init__()
        self.launch, self.alloc, self.view = Counter(), Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        schema, name = func._schema, func.overloadpacket.__name__
        aliases = any(r.alias_info is not None for r in schema.returns)
        if aliases and not schema.is_mutable:
            self.view[name] += 1  # a view: host work, no kernel, no memory
            return out
        if name not in _ALLOCATING_NO_LAUNCH:
            self.launch[name] += 1
        if not aliases:
            self.alloc[name] += 1
        return out


def _fake_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, *, output_dtype):  # type: ignore[no-untyped-def]
    _fake_scaled_mm.calls += 1  # type: ignore[attr-defined]
    return torch.empty(a.shape[0], b.shape[1], dtype=output_dtype)


_fake_scaled_mm.calls = 0  # type: ignore[attr-defined]


@pytest.fixture
def host_path(monkeypatch):  # type: ignore[no-untyped-def]
    """The H100 configuration on CPU tensors: Triton quantizers, scaled_mm GEMMs, direct
    Triton launches; kernels are stand-ins (see the module docstring). Yields the launch log."""
    if not triton_launch.interpreting():
        pytest.skip("emulates the CUDA path on CPU tensors; a GPU runs the real one")
    launches: list = []
    monkeypatch.setenv("JETRL_FP8_QUANT_BACKEND", "triton")
    monkeypatch.setattr(linear, "_on_gpu", lambda t: True)
    monkeypatch.setattr(linear_plan, "plan_gemm", lambda *a, **k: GemmPlan("scaled_mm", "test"))
    monkeypatch.setattr(F, "scaled_mm", _fake_scaled_mm)
    for name in ("quantize_rowcol_kernel", "quantize_kernel"):
        monkeypatch.setattr(_triton_jit, name, FakeJit(getattr(_triton_jit, name), launches))
    direct_launches_on(monkeypatch)
    finite_flags._FLAGS.clear()
    yield launches
    finite_flags._FLAGS.clear()


def _frames(fn) -> tuple[object, Counter]:  # type: ignore[no-untyped-def]
    """``fn()`` and its Python calls, keyed ``ours`` (nemo_jetrl) / ``other``."""
    seen: Counter = Counter()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call":
            seen["ours" if frame.f_code.co_filename.startswith(PACKAGE) else "other"] += 1

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    seen["other"] -= 1  # the setprofile(None) call itself
    return out, seen


def _budget(prepare, launches: list) -> dict:  # type: ignore[no-untyped-def]
    """Counts of the call ``prepare()`` returns (preparing is not counted): its frames in one
    call, its torch ops and launches in a second."""
    _, frames = _frames(prepare())
    fn = prepare()
    _fake_scaled_mm.calls, before = 0, len(launches)  # type: ignore[attr-defined]
    ops = _Ops()
    with ops:
        fn()
    direct = [x for x in launches[before:] if x[0] == "direct"]
    assert len(direct) == len(launches) - before, "a JIT launch in the steady state"
    aten = sum(ops.launch.values())
    return {
        "frames": frames["ours"],
        "launches": len(direct) + _fake_scaled_mm.calls + aten,  # type: ignore[attr-defined]
        "allocations": sum(ops.alloc.values()),
        "views": sum(ops.view.values()),
        "detail": (frames, dict(ops.launch), dict(ops.alloc), dict(ops.view)),
    }


def _layer_and_inputs(tokens: int = 256):  # type: ignore[no-untyped-def]
    layer = Fp8BlockLinear(512, 384, bias=False, dtype=torch.bfloat16, name="blk",
                           config=Fp8LinearConfig())  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 512, generator=g).to(torch.bfloat16).requires_grad_(True)
    return layer, x, torch.randn(tokens, 384, generator=g).to(torch.bfloat16)


def _steady_step(layer, x, dy, launches) -> tuple[dict, dict]:  # type: ignore[no-untyped-def]
    """Counts of one forward and one backward after two warm-up steps (plan, weight cache,
    flags and compiled-launcher caches filled)."""
    for _ in range(2):
        layer(x).backward(dy)

    def backward():  # type: ignore[no-untyped-def]
        x.grad = layer.weight.grad = None  # as a step after zero_grad(set_to_none=True)
        return partial(layer(x).backward, dy)

    return _budget(lambda: partial(layer, x), launches), _budget(backward, launches)


# Measured on this code (issue 48; at 166ab5b, before: forward 36 frames / 15 views, backward
# 39 / 18, with the JIT launch's own frames not counted). Forward frames: forward, plan_for/
# plan_key, the cached weight (_weight/lookup/_key), the rowcol quantization (fused: one call,
# +4 CPU-only frames, see the docstring), one direct launch a kernel (launch/_spec), flag, FProp
# through fp8_linear_forward/linear_gemm/fp8_gemm/run_gemm/_scaled_mm and its scale helpers;
# +1 since 166ab5b: `linear._capturing` (the weight cache skipped while a graph is captured).
# Launches: the quantizer kernel(s) and the FProp GEMM. Allocations: 2 code arrays + 2 scale
# arrays, the GEMM output. Backward: dy's quantization, DGrad and WGrad GEMMs; allocations 2 + 2
# for dy, 2 GEMM outputs (dW is taken as the weight's .grad, dx as x's: no copies).
# two_pass (the default since 2026-12-04): 1x128, then 128x1 transposed: 15 frames a quantizer
# call (13 on a CUDA tensor) where the fused call takes 11 + 4 of its own, one more launch and
# 3 more views (scale view, .t() and the transposed result) a tensor; no fill kernel since the
# MN-major scale buffer at M % 4 == 0 is `empty` (2 `zeros` launches a step before).
HOST_BUDGET = {
    "fused": ({"frames": 31, "launches": 2, "allocations": 5, "views": 13},
              {"frames": 31, "launches": 3, "allocations": 6, "views": 16}),
    "two_pass": ({"frames": 51, "launches": 3, "allocations": 5, "views": 16},
                 {"frames": 51, "launches": 4, "allocations": 6, "views": 19}),
}  # fmt: skip


@pytest.mark.parametrize("rowcol", ["fused", "two_pass"])
def test_one_forward_and_backward_stay_within_the_host_budget(host_path, monkeypatch, rowcol):
    monkeypatch.setenv(linear_plan.ENV_ROWCOL, rowcol)
    layer, x, dy = _layer_and_inputs()
    fwd, bwd = _steady_step(layer, x, dy, host_path)
    want_fwd, want_bwd = HOST_BUDGET[rowcol]
    got_fwd = {k: fwd[k] for k in want_fwd}
    got_bwd = {k: bwd[k] for k in want_bwd}
    assert (got_fwd, got_bwd) == (want_fwd, want_bwd), repr((fwd["detail"], bwd["detail"]))


def test_the_quantizer_alone_stays_within_the_host_budget(host_path):
    x = torch.randn(256, 512).to(torch.bfloat16)
    for _ in range(2):  # warm-up: launch settings and the compiled launcher cached
        quantize_blockwise_triton(x, (1, 128), check_finite=False)
    call = partial(quantize_blockwise_triton, x, (1, 128), check_finite=False)
    got = _budget(lambda: call, host_path)
    # 166ab5b: 16 frames (the JIT launch's own not counted). Allocations: codes and scales.
    want = {"frames": 14, "launches": 1, "allocations": 2, "views": 5}
    assert {k: got[k] for k in want} == want, repr(got["detail"])


# ------------------------------------------------------------------ direct Triton launches


def test_each_specialisation_launches_through_triton_once_then_directly(host_path):
    x = torch.randn(256, 512).to(torch.bfloat16)
    for _ in range(3):
        quantize_blockwise_triton(x, (1, 128), check_finite=False)
    assert [e[0] for e in host_path] == ["jit", "direct", "direct"]
    assert host_path[0][2] is False  # the JIT launch keeps the no-FTZ option
    # the direct call passes JITFunction.run's launcher arguments: grid, stream, handle, metadata
    grid, hooks = host_path[1][1], host_path[1][2]
    assert grid == (4, 4, 1) and hooks == (None, None, None)
    # a pointer off 16-byte alignment is another Triton specialisation: through Triton again
    odd = torch.randn(257 * 512).to(torch.bfloat16)[1 : 1 + 256 * 512].view(256, 512)
    quantize_blockwise_triton(odd, (1, 128), check_finite=False)
    quantize_blockwise_triton(odd, (1, 128), check_finite=False)
    assert [e[0] for e in host_path[3:]] == ["jit", "direct"]
    # another token count of the same size classes (M % 16 == 0, not 1) is the same kernel
    quantize_blockwise_triton(x[:128], (1, 128), check_finite=False)
    assert host_path[-1][0] == "direct"
    quantize_blockwise_triton(x[:1], (1, 128), check_finite=False)  # M == 1: specialised
    assert host_path[-1][0] == "jit"


def test_a_launch_hook_sends_every_launch_through_triton(host_path, monkeypatch):
    x = torch.randn(256, 512).to(torch.bfloat16)
    quantize_blockwise_triton(x, (1, 128), check_finite=False)
    hooked = SimpleNamespace(
        launch_enter_hook=SimpleNamespace(calls=[print]), launch_exit_hook=None
    )
    monkeypatch.setitem(triton_launch._DIRECT, "runtime", hooked)
    quantize_blockwise_triton(x, (1, 128), check_finite=False)
    assert [e[0] for e in host_path] == ["jit", "jit"]  # a profiler's hook sees the launch


def test_direct_launches_fall_back_explicitly(monkeypatch):
    import triton

    monkeypatch.setattr(triton_launch, "_DIRECT", {"on": None, "why": ""})
    monkeypatch.setattr(triton_launch, "interpreting", lambda: False)
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    with pytest.warns(UserWarning, match=r"Triton 3.5.1 is outside the versions read"):
        assert triton_launch._decide() is False
    assert triton_launch.direct_launch_status() == (
        False, "Triton 3.5.1 is outside the versions read ((3, 6), (3, 9))")  # fmt: skip
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setenv(triton_launch.ENV_DIRECT_LAUNCH, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # turned off on purpose: no warning
        assert triton_launch._decide() is False
    assert triton_launch.direct_launch_status()[1] == "JETRL_TRITON_DIRECT_LAUNCH=0"
    monkeypatch.setenv(triton_launch.ENV_DIRECT_LAUNCH, "yes")
    with pytest.raises(ValueError, match="JETRL_TRITON_DIRECT_LAUNCH is 'yes'; use 0 or 1"):
        triton_launch._decide()


def test_a_compiled_kernel_without_a_launcher_turns_direct_launches_off(host_path, monkeypatch):
    x = torch.randn(256, 512).to(torch.bfloat16)
    kernel = _triton_jit.quantize_kernel
    monkeypatch.setattr(kernel, "compiled", SimpleNamespace(function=1, packed_metadata=()))
    with pytest.warns(UserWarning, match="compiled kernel or quantize_kernel's parameters differ"):
        quantize_blockwise_triton(x, (1, 128), check_finite=False)
    quantize_blockwise_triton(x, (1, 128), check_finite=False)
    assert triton_launch.direct_launch_status()[0] is False
    assert [e[0] for e in host_path] == ["jit", "jit"]


# ------------------------------------------------------------------------------ GPU tier


@pytest.mark.gpu
def test_direct_launches_give_the_triton_launch_bits_on_a_gpu(monkeypatch):
    """Compiled kernels: the direct launcher is taken (Triton 3.6 on the GPU image) and gives
    the bits JITFunction.run gives, for the quantizer and the fused rowcol kernel, through an
    aligned and a misaligned input and a linear's fwd+bwd."""
    from nemo_jetrl.fp8 import fp8_bits
    from nemo_jetrl.fp8.rowcol_quantize import quantize_rowcol_triton

    if triton_launch.interpreting():
        pytest.skip("compiled kernels only")
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(300 * 640 + 1, generator=g) * 3).to(torch.bfloat16).cuda()
    inputs = [base[: 300 * 640].view(300, 640), base[1:].view(300, 640)]  # 2 B off 16 B

    def results():  # type: ignore[no-untyped-def]
        out = []
        for x in inputs:
            for _ in range(2):  # the second call of each specialisation is a direct one
                q = quantize_blockwise_triton(x, (1, 128), check_finite=False)
                qt = quantize_blockwise_triton(x, (128, 1), transpose=True, check_finite=False)
                row, col = quantize_rowcol_triton(x, check_finite=False, scale_layout="mn_major")
            out += [fp8_bits(t.data) for t in (q, qt, row, col)]
            out += [t.scale_inv.contiguous() for t in (q, qt, row, col)]
        torch.manual_seed(0)
        layer = Fp8BlockLinear(640, 256, bias=False, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            x = inputs[0].detach().requires_grad_(True)
            layer(x).backward(torch.ones(300, 256, device="cuda", dtype=torch.bfloat16))
        return [*out, x.grad, layer.weight.grad]

    monkeypatch.setattr(triton_launch, "_COMPILED", {})
    direct = results()
    assert triton_launch.direct_launch_status()[0] is True, triton_launch.direct_launch_status()
    assert len(triton_launch._COMPILED) >= 6
    monkeypatch.setitem(triton_launch._DIRECT, "on", False)  # every launch through Triton
    through_triton = results()
    finite_flags._FLAGS.clear()
    for a, b in zip(direct, through_triton, strict=True):
        assert torch.equal(a, b)
