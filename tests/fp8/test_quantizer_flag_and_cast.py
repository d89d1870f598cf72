"""Issue 35's quantizers: the non-finite flag set in the kernel, and the hardware FP8 cast.

CPU: the kernels run under TRITON_INTERPRET=1 (conftest). The interpreter's own FP8 conversion
does not round to nearest-even, so the hardware-cast path (``native_cast=True``) is checked on
CPU only where it cannot differ (scales, signs, the flag, the launch options); its codes are
compared with the software encode on every finite bf16 bit pattern by the `gpu` tests at the end.
"""

from __future__ import annotations

import pytest
import torch
from fp8_inventory import Inventory, record_triton
from quantizer_cases import MODES, _all_finite_bf16, _bits, _input, assert_same
from triton_setup import BLOCKS, DEVICE, TRITON_MARKS

from nemo_jetrl.fp8 import finite_flags, quantize_blockwise
from nemo_jetrl.fp8.rowcol_quantize import quantize_rowcol, quantize_rowcol_triton

pytestmark = TRITON_MARKS


# --------------------------------------------------------------------- the flag in the kernel


def _quantizers():
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton, rmsnorm_quantize_1x128

    calls = {f"{b[0]}x{b[1]}": (lambda x, b=b, **kw: quantize_blockwise_triton(x, b, **kw))
             for b in BLOCKS}  # fmt: skip
    calls["128x1-transposed"] = lambda x, **kw: quantize_blockwise_triton(
        x, (128, 1), transpose=True, **kw
    )
    calls["rowcol"] = quantize_rowcol_triton
    calls["rmsnorm"] = lambda x, **kw: rmsnorm_quantize_1x128(
        x, torch.ones(x.shape[-1], dtype=x.dtype, device=x.device), **kw
    )
    return calls


@pytest.mark.parametrize("which", sorted(_quantizers()))
@pytest.mark.parametrize("native", [False, True])
def test_kernel_sets_the_flag_only_for_non_finite_input(which, native):
    quantize = _quantizers()[which]
    x = _input(200, 300, torch.bfloat16, seed=12).to(DEVICE)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    quantize(x, check_finite=False, nonfinite_flag=flag, native_cast=native)
    assert int(flag) == 0, which
    for r, c, bad in ((199, 299, float("nan")), (0, 0, float("inf")), (130, 5, float("-inf"))):
        y = x.clone()
        y[r, c] = bad
        flag.zero_()
        quantize(y, check_finite=False, nonfinite_flag=flag, native_cast=native)
        assert int(flag) == 1, (which, r, c)


@pytest.fixture
def counted(monkeypatch):
    from nemo_jetrl.fp8 import triton_kernels

    if not triton_kernels.interpreting():
        pytest.skip("counts interpreter launches on CPU tensors")
    inventory = Inventory()
    record_triton(monkeypatch, inventory)
    finite_flags._FLAGS.clear()
    yield inventory
    finite_flags._FLAGS.clear()


def _deferred_old(x, block, name):
    """The deferred quantization of the tree before issue 35 (linear._quantize): quantize
    unchecked, then `finite_flags.record` (isnan + any (+ logical_or) on the scales)."""
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

    q = quantize_blockwise_triton(x, block, check_finite=False, name=name)
    finite_flags.record(name, q.scale_inv)


def _deferred_new(x, block, name):
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

    flag = finite_flags.flag(name, x.device)
    quantize_blockwise_triton(x, block, check_finite=False, name=name, nonfinite_flag=flag)


def _deferred_rowcol(x, block, name):
    quantize_rowcol(x, backend="triton", check_finite=False, nonfinite_flag=finite_flags.flag(
        name, x.device))  # fmt: skip


def _launches_of_second_call(counted, run):
    x = _input(130, 256, torch.bfloat16, seed=2)
    run(x, (1, 128), "blk.input")  # the first step allocates the flag (once per run)
    finite_flags.check_non_finite()
    counted.ops.clear()
    with counted:
        run(x, (1, 128), "blk.input")
    finite_flags.check_non_finite()  # finite: no error
    return counted.launches()


@pytest.mark.parametrize("how", ["quantize_kernel", "quantize_rowcol_kernel"])
def test_one_deferred_quantization_is_one_kernel(counted, how):
    """Kernels of one sync-free quantization after its first step: the quantizer, nothing else
    (no isnan/any/logical_or flag kernels, no fills)."""
    run = _deferred_new if how == "quantize_kernel" else _deferred_rowcol
    launches = _launches_of_second_call(counted, run)
    assert launches == [f"triton:{how}"], launches


def test_the_inventory_sees_the_old_flag_kernels(counted):
    """The same count on the pattern every deferred quantization used before issue 35
    (quantize, then `finite_flags.record`): its separate flag kernels show, so the test above
    fails on it."""
    launches = _launches_of_second_call(counted, _deferred_old)
    assert launches[0] == "triton:quantize_kernel" and {"isnan", "any"} <= set(launches[1:])


def test_flag_buffers_are_reused_and_the_error_names_the_tensor():
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

    finite_flags._FLAGS.clear()
    finite_flags._SPARE.clear()
    x = _input(130, 256, torch.bfloat16, seed=3).to(DEVICE)
    f1 = finite_flags.flag("blk.input", x.device)
    assert finite_flags.flag("blk.input", x.device) is f1 and finite_flags.pending() == 1
    quantize_blockwise_triton(x, (1, 128), check_finite=False, nonfinite_flag=f1)
    finite_flags.check_non_finite()
    assert finite_flags.pending() == 0
    f2 = finite_flags.flag("blk.input", x.device)
    assert f2 is f1 and int(f2) == 0  # the same buffer, zeroed after the read
    x[5, 7] = float("nan")
    quantize_blockwise_triton(x, (128, 1), check_finite=False, nonfinite_flag=f2)
    finite_flags.record("blk.grad_output", torch.ones(2, 2, device=DEVICE))  # finite
    with pytest.raises(ValueError, match=r"FP8 operand\(s\) \['blk.input'\]"):
        finite_flags.check_non_finite()
    assert int(finite_flags.flag("blk.input", x.device)) == 0
    finite_flags.check_non_finite()
    finite_flags._SPARE.clear()


# ------------------------------------------------------------------------------- hardware cast


def test_native_cast_default_rule(monkeypatch):
    """The default: hardware cast for CUDA tensors on SM89+ in compiled kernels, never under the
    interpreter; JETRL_FP8_NATIVE_CAST=0 turns it off. (The device query is faked: no GPU.)"""
    from nemo_jetrl.fp8 import triton_kernels as tk

    x = torch.zeros(1)
    assert tk.resolve_native_cast(x, None) is False
    assert tk.resolve_native_cast(x, True) is True and tk.resolve_native_cast(x, False) is False
    for cap, env, want in (((9, 0), None, True), ((8, 9), "1", True), ((8, 0), None, False),
                           ((9, 0), "0", False), ((10, 0), None, True)):  # fmt: skip
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i, cap=cap: cap)
        if env is None:
            monkeypatch.delenv(tk.ENV_NATIVE_CAST, raising=False)
        else:
            monkeypatch.setenv(tk.ENV_NATIVE_CAST, env)
        tk._native_cast_on.cache_clear()
        assert tk._native_cast_on(0) is want, (cap, env)
    monkeypatch.setenv(tk.ENV_NATIVE_CAST, "yes")
    tk._native_cast_on.cache_clear()
    with pytest.raises(ValueError, match="JETRL_FP8_NATIVE_CAST is 'yes'; use 0 or 1"):
        tk._native_cast_on(0)
    tk._native_cast_on.cache_clear()


@pytest.mark.parametrize("which", sorted(_quantizers()))
def test_native_path_runs_and_only_its_codes_can_differ_here(which):
    """Under the interpreter the hardware path's codes are the interpreter's (not RNE); its
    scales and signs are the software path's bit for bit (the cast touches neither)."""
    quantize = _quantizers()[which]
    x = _input(200, 300, torch.bfloat16, seed=13).to(DEVICE)
    soft = quantize(x, native_cast=False)
    hard = quantize(x, native_cast=True)
    soft = soft if isinstance(soft, tuple) else (soft,)
    hard = hard if isinstance(hard, tuple) else (hard,)
    for s, h in zip(soft, hard, strict=True):
        if isinstance(s, torch.Tensor):  # rmsnorm's y
            assert torch.equal(s, h)
            continue
        (sd, ss), (hd, hs) = _bits(s), _bits(h)
        assert torch.equal(ss, hs), which
        assert torch.equal(sd & 0x80, hd & 0x80), which
        if DEVICE == "cuda":
            assert torch.equal(sd, hd), which


def test_every_rowcol_launch_disables_ftz(monkeypatch):
    import nemo_jetrl.fp8._triton_jit as jit_module

    seen: list = []
    kernel = jit_module.quantize_rowcol_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs)
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(jit_module, "quantize_rowcol_kernel", Spy())
    quantize_rowcol_triton(torch.ones(130, 256, device=DEVICE), check_finite=False)
    assert len(seen) == 1 and seen[0].get("enable_reflect_ftz") is False


# ------------------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["sorted", "shuffled"])
@pytest.mark.parametrize("block", BLOCKS, ids=["1x128", "128x128", "128x1"])
def test_gpu_hardware_cast_equals_software_encode_on_every_finite_bf16(block, layout):
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton

    x = _all_finite_bf16(layout)
    for src in (x, x.t().contiguous()):  # each pattern in rows and in columns of blocks
        xc = src.cuda()
        for fmt, pow2 in MODES:
            kw = {"fmt": fmt, "pow2_scales": pow2}
            soft = quantize_blockwise_triton(xc, block, native_cast=False, **kw)
            hard = quantize_blockwise_triton(xc, block, native_cast=True, **kw)
            default = quantize_blockwise_triton(xc, block, **kw)
            want = quantize_blockwise(src, block, **kw)
            for got, label in ((soft, "soft"), (hard, "hard"), (default, "default")):
                assert_same(got, want, f"{label} {fmt} pow2={pow2} {block} {layout}")


@pytest.mark.gpu
def test_gpu_flagged_quantization_in_a_cuda_graph():
    """The sync-free path is capturable: the kernel's flag is set on replay with NaN input."""
    x = _input(256, 4096, torch.bfloat16, seed=2).cuda()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    kw = {"check_finite": False, "nonfinite_flag": flag}
    quantize_rowcol_triton(x, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantize_rowcol_triton(x, **kw)
    graph.replay()
    assert int(flag) == 0
    x[100, 1000] = float("nan")
    graph.replay()
    assert int(flag) == 1
