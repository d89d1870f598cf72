"""One serving call of our vLLM kernel, as vLLM makes it, op by op (no vLLM needed).

A layer planned on cuBLASLt (``scaled_mm``, what an H100 without DeepGEMM plans) or on DeepGEMM
is loaded and applied through the kernel class's own methods, and a `TorchDispatchMode` records every aten op
and every Triton launch of ``apply_weights``. Per call only the quantizer's launch, the GEMM and
plain allocations (the FP8 activations, their scales, the output) may run: no zeros, pads,
copies or transposed copies of scales, and no decode batch (M % 4 != 0) off cuBLASLt.

Stand-ins (`serving_inventory`): vLLM's kernel base classes, ``F.scaled_mm`` itself (it cannot
run on a CPU with blockwise scales) and DeepGEMM's module; the Triton kernels run in the CPU
interpreter.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from serving_inventory import (
    OpRecorder,
    StandInBase,
    StandInMM,
    deep_gemm_standin,
    op_bodies,
    plan_as,
    recording,
    scaled_mm_standin,
    served_layer,
)

from nemo_jetrl.fp8 import gemm_backends, quantize_blockwise, triton_kernels
from nemo_jetrl.vllm_patch import compat, kernel, serving_ops

pytestmark = pytest.mark.skipif(
    not triton_kernels.can_run(torch.zeros(1, dtype=torch.bfloat16)),
    reason="needs triton (its interpreter on CPU): the quantizer's launch is what is counted",
)
N, K = 256, 384  # K/128 = 3 scale columns: cuBLASLt wants them padded to 4


def _loaded_layer(monkeypatch, backend: str, pow2: bool, w: torch.Tensor):
    monkeypatch.setattr(compat, "kernel_base_classes", lambda: (StandInBase, StandInMM))
    # vLLM's DeepGEMM warm-up token counts (its config): none, no warm-up GEMMs at load here.
    monkeypatch.setattr(compat, "deep_gemm_warmup_m_values", lambda weight: [])
    plan_as(monkeypatch, kernel, backend)
    monkeypatch.setattr(kernel, "ensure_ops", op_bodies)
    # CUDA tensors get the Triton quantizer: route CPU tensors there too (interpreter).
    monkeypatch.setattr(
        serving_ops, "quantize_blockwise", partial(quantize_blockwise, backend="triton")
    )
    return served_layer(w, pow2)


@pytest.mark.parametrize("m", [37, 64, 1])
@pytest.mark.parametrize("backend", ["scaled_mm", "deep_gemm"])
def test_one_serving_call_runs_the_quantizer_the_gemm_and_nothing_else(monkeypatch, backend, m):
    """On the code before this test (commit 696f711), scaled_mm: M=64 ran zeros + copy_ padding
    the weight's scales and a clone transposing the activation scales around F.scaled_mm; M=37
    and M=1 ran the Triton GEMM (a third launch) instead of cuBLASLt. deep_gemm (stood in; it
    writes into the output it is given): a zeros fill of the MN-major scale buffer per call."""
    calls: list = []
    monkeypatch.setattr(F, "scaled_mm", scaled_mm_standin(calls, compute=False))
    monkeypatch.setattr(gemm_backends, "deep_gemm_module", lambda: deep_gemm_standin(calls))
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    kern, layer, _ = _loaded_layer(monkeypatch, backend, False, w)
    x = torch.randn(m, K, generator=g).bfloat16()
    kern.apply_weights(layer, x)  # first call outside: Triton compiles, tables are built
    calls.clear()
    with recording(monkeypatch, OpRecorder()) as rec:
        y = kern.apply_weights(layer, x)
    assert y.shape == (m, N)
    assert rec.work_ops() == {}, f"per-call work besides the kernels: {dict(rec.work_ops())}"
    assert rec.launches == ["quantize_kernel"], rec.launches
    assert len(calls) == 1, f"the GEMM did not run on (the stand-in for) {backend}"
    assert rec.allocations() <= 3, dict(rec.ops)  # FP8 x, its scales, the output
