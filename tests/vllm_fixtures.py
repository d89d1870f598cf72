"""Shared set-up of the `vllm` test modules (real vLLM CPU build, scripts/test_vllm.sh)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

# tests/vllm_patch/standins/jetrl_onednn_standin.py: a labelled stand-in for vLLM's oneDNN calls
STANDINS = Path(__file__).resolve().parent / "vllm_patch" / "standins"
# The decoder linears of tests/hf_models.tiny_llama_128 (2 layers) under vLLM's fused names.
DECODER_LINEARS = {
    f"model.layers.{i}.{m}"
    for i in range(2)
    for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
}


@contextmanager
def vllm_cpu_env() -> Iterator[None]:
    """CPU build: KV cache size in GiB of host memory (small: shared machine); no core pinning
    (the value that means that differs by vLLM version, see compat.cpu_omp_threads_bind).
    Variables the caller already set are kept; the rest are restored on exit."""
    from nemo_jetrl.vllm_patch.compat import cpu_omp_threads_bind

    with pytest.MonkeyPatch.context() as mp:
        for key, value in (
            ("VLLM_CPU_KVCACHE_SPACE", "1"),
            ("VLLM_CPU_OMP_THREADS_BIND", cpu_omp_threads_bind()),
        ):
            if key not in os.environ:
                mp.setenv(key, value)
        yield


@contextmanager
def onednn_standin(active: bool, monkeypatch=None):
    """The stand-in plugin for this process (in-process checks) and, through the environment,
    for vLLM's engine processes; everything restored on exit."""
    if not active:
        yield
        return
    sys.path.insert(0, str(STANDINS))
    import jetrl_onednn_standin as standin

    saved = standin.apply()
    if monkeypatch is not None:
        monkeypatch.setenv(standin.ENV, "1")
        path = os.pathsep.join([str(STANDINS), os.environ.get("PYTHONPATH", "")])
        monkeypatch.setenv("PYTHONPATH", path)
    try:
        yield
    finally:
        standin.revert(saved)
        sys.path.remove(str(STANDINS))


def vllm_repacks(dtype: torch.dtype) -> bool:
    """Ask vLLM's own CPU dispatch (in this process) whether it repacks a [256, 256] weight."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # the _C library vLLM loads for this CPU
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(256, 256, dtype=dtype), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    return layer.weight.numel() == 0
