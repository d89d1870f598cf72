"""Helpers for the serving-call tests (no vLLM needed): stand-ins and an aten-op recorder.

Stand-ins, each labelled where it is used, for what cannot run on this CPU:

* `StandInBase` / `StandInMM`: vLLM's kernel base classes (``compat.kernel_base_classes``), so
  our kernel class is built and driven exactly as vLLM drives it (``__init__(config)``,
  ``process_weights_after_loading(layer)``, ``apply_weights(layer, x)``) without vLLM;
* `scaled_mm_standin`: ``torch.nn.functional.scaled_mm`` with blockwise scales (cuBLASLt, SM90
  only). It refuses what cuBLASLt refuses (M % 4, scale strides, `check_scaled_mm_args`) and
  computes the product from the operands and scales it was handed with the reference GEMM
  (`gemm.blockwise_matmul`), so wrong layouts or padded rows that leak show in the values.
"""

from __future__ import annotations

import contextlib
import types
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from nemo_jetrl.fp8 import BlockQuantized
from nemo_jetrl.fp8.gemm import blockwise_matmul
from nemo_jetrl.fp8.gemm_backends import GemmPlan

# aten ops that only make views or metadata (no memory written, no kernel on a GPU).
_VIEWS = "t view _unsafe_view slice as_strided alias detach transpose permute expand select"
VIEW_OPS = frozenset(f"{_VIEWS} unsqueeze squeeze _reshape_alias reshape lift_fresh".split(" "))
# Allocations without a fill (a caching-allocator call on a GPU, no kernel).
ALLOC_OPS = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"})


class OpRecorder(TorchDispatchMode):
    """Records every aten op (by short name) and every kernel launch `launch` reports."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.launches: list[str] = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))

    def work_ops(self) -> Counter[str]:
        """Ops that write memory or run a kernel outside the recorded launches (pads, zeros,
        fills, copies, transposed copies, casts): everything but views and plain allocations."""
        return Counter({k: v for k, v in self.ops.items() if k not in VIEW_OPS | ALLOC_OPS})

    def allocations(self) -> int:
        return sum(v for k, v in self.ops.items() if k in ALLOC_OPS)


class _Launcher:
    """Wraps a Triton JIT function: each ``kernel[grid](...)`` is one recorded launch, run with
    the recorder switched off (the CPU interpreter copies arguments around; a GPU does not)."""

    def __init__(self, name: str, fn: Any, rec: OpRecorder) -> None:
        self.name, self.fn, self.rec = name, fn, rec

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.rec.launches.append(self.name)
            with _disable_current_modes():
                return self.fn[grid](*args, **kwargs)

        return launch


class _JitModule:
    """A Triton JIT module whose ``*_kernel`` attributes are `_Launcher`s."""

    def __init__(self, real: Any, rec: OpRecorder) -> None:
        self._real, self._rec = real, rec

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        return _Launcher(name, value, self._rec) if name.endswith("_kernel") else value


def op_bodies() -> Any:
    """Our two custom ops' bodies under the ops' names: a dispatch mode sees a custom op as one
    op (its body runs with the mode off), so the kernel class is built on these to see inside.
    The bodies are exactly what the ops run (``kernel.ensure_ops``)."""
    from nemo_jetrl.vllm_patch import kernel

    return types.SimpleNamespace(
        quantize_act_1x128=kernel._quantize_act_impl, fp8_block_gemm=kernel._gemm_impl
    )


@contextlib.contextmanager
def recording(monkeypatch: Any, rec: OpRecorder):  # type: ignore[no-untyped-def]
    """Route the Triton quantizer's and GEMM's launches through `_Launcher`s, then record."""
    from nemo_jetrl.fp8 import triton_gemm, triton_kernels

    for module, getter in ((triton_kernels, "_kernels"), (triton_gemm, "_kernel")):
        real = getattr(module, getter)()
        monkeypatch.setattr(module, getter, lambda r=real: _JitModule(r, rec))
    with rec:
        yield rec


def check_scaled_mm_args(a, b, scale_a, recipe_a, scale_b, recipe_b) -> None:  # type: ignore[no-untyped-def]
    """What cuBLASLt's blockwise FP8 accepts (torch 2.11 / CUDA 13.0 on an H100, measured with
    benchmarks/gpu/probe_scaled_mm.py): a [M, K] row-major with M % 4 == 0, b [K, N] column-major,
    scale_a [M, kb] with strides (1, M), a 128x128 scale_b [pad4(kb), N/128] with strides
    (1, pad4(kb))."""
    import torch.nn.functional as F

    m, k = a.shape
    kb = -(-k // 128)
    kb4 = -(-kb // 4) * 4
    assert m % 4 == 0, f"cuBLASLt NOT_SUPPORTED: M={m}"
    assert a.stride() == (k, 1) and b.stride() == (1, k), (a.stride(), b.stride())
    assert recipe_a == F.ScalingType.BlockWise1x128
    assert tuple(scale_a.shape) == (m, kb) and scale_a.stride() == (1, m), scale_a.stride()
    if recipe_b == F.ScalingType.BlockWise128x128:
        nb = -(-b.shape[1] // 128)
        assert tuple(scale_b.shape) == (kb4, nb) and scale_b.stride() == (1, kb4), (
            tuple(scale_b.shape),
            scale_b.stride(),
        )


def scaled_mm_standin(calls: list, *, compute: bool):  # type: ignore[no-untyped-def]
    """A stand-in for blockwise ``F.scaled_mm`` (see the module docstring). ``compute=False``:
    only the output allocation (what cuBLASLt allocates too), for the op inventory."""
    import torch.nn.functional as F

    def scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, *, output_dtype, **_):  # type: ignore[no-untyped-def]
        calls.append((tuple(a.shape), scale_a.stride(), scale_b.stride()))
        check_scaled_mm_args(a, b, scale_a, recipe_a, scale_b, recipe_b)
        if not compute:
            return a.new_empty((a.shape[0], b.shape[1]), dtype=output_dtype)
        with _disable_current_modes():
            kb = scale_a.shape[1]
            qa = BlockQuantized(a, scale_a.contiguous(), (1, 128), "e4m3", False)
            if recipe_b == F.ScalingType.BlockWise128x128:
                sb = scale_b.t()[:, :kb].contiguous()
                qb = BlockQuantized(b.t(), sb, (128, 128), "e4m3", False)
            else:
                qb = BlockQuantized(b.t(), scale_b.contiguous(), (1, 128), "e4m3", False)
            return blockwise_matmul(qa, qb, out_dtype=output_dtype)

    return scaled_mm


def deep_gemm_standin(calls: list) -> Any:
    """A stand-in for DeepGEMM's module (SM90 only): ``fp8_gemm_nt`` checks the layouts DeepGEMM
    reads without a transpose (a, b row-major; ``sfa`` MN-major ``[M, kb]`` with strides
    ``(1, pad4(M))``, TMA-aligned; ``sfb`` compact) and allocates nothing (it writes ``out``)."""

    def fp8_gemm_nt(a_pair, b_pair, out, **_kw):  # type: ignore[no-untyped-def]
        (a, sfa), (b, sfb) = a_pair, b_pair
        m, k = a.shape
        calls.append((tuple(a.shape), sfa.stride()))
        assert a.is_contiguous() and b.is_contiguous() and sfb.is_contiguous()
        assert tuple(sfa.shape) == (m, -(-k // 128)) and sfa.stride() == (1, -(-m // 4) * 4)
        assert tuple(out.shape) == (m, b.shape[0])

    return types.SimpleNamespace(__name__="deep_gemm_standin", fp8_gemm_nt=fp8_gemm_nt)


class StandInMM:
    """Stand-in for vLLM's ``MMLinearKernel`` (keeps ``config``, as vLLM's does)."""

    def __init__(self, config: Any) -> None:
        self.config = config


class StandInBase(StandInMM):
    """Stand-in for vLLM's ``Fp8BlockScaledMMLinearKernel`` (our class skips its __init__)."""


def standin_config(shape: tuple[int, int], out_dtype=torch.bfloat16) -> Any:  # type: ignore[no-untyped-def]
    """The fields of vLLM's ``FP8ScaledMMLinearLayerConfig`` our kernel reads."""
    group = types.SimpleNamespace(row=128, col=128)
    wkey = types.SimpleNamespace(scale=types.SimpleNamespace(group_shape=group))
    return types.SimpleNamespace(weight_quant_key=wkey, weight_shape=shape, out_dtype=out_dtype)


def served_layer(w: torch.Tensor, pow2: bool) -> tuple[Any, torch.nn.Module, BlockQuantized]:
    """(kernel, layer, quantized weight): our kernel class as vLLM builds it, holding ``w``
    quantized 128x128 and loaded as vLLM loads it (`process_weights_after_loading`)."""
    from nemo_jetrl.fp8 import quantize_blockwise
    from nemo_jetrl.vllm_patch import kernel
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    settings = PatchSettings(pow2_weight_scales=pow2, pow2_activation_scales=pow2)
    kern = kernel.make_kernel_class(settings)(standin_config(tuple(w.shape)))
    qw = quantize_blockwise(w, (128, 128), pow2_scales=pow2)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(qw.data, requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(qw.scale_inv.clone(), requires_grad=False)
    kern.process_weights_after_loading(layer)
    return kern, layer, qw


def plan_as(monkeypatch: Any, kernel_module: Any, backend: str) -> None:
    """Plan every layer on ``backend`` (a GPU backend on this CPU: the plan is what a GPU's
    would be; the runners are real, or stand-ins where named) and let run_gemm use Triton."""
    from nemo_jetrl.fp8 import gemm_backends

    monkeypatch.setattr(
        kernel_module, "plan_gemm", lambda *a, **k: GemmPlan(backend, "test: as on an H100")
    )
    caps = gemm_backends.DeviceCaps(
        cuda=True, sm=(9, 0), deep_gemm=True, scaled_mm=True, triton=True
    )
    monkeypatch.setattr(gemm_backends, "device_caps", lambda device: caps)
