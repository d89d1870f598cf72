"""TEST STAND-IN, not vLLM and not oneDNN: makes vLLM's CPU build take its oneDNN linear branch.

vLLM's CPU build repacks unquantized linear weights for oneDNN after loading
(``dispatch_cpu_unquantized_gemm``) where its compiled library has oneDNN and oneDNN supports the
dtype on this CPU (BF16: AVX-512 only; vLLM 0.20's AVX2 library has no oneDNN at all). So that
this branch of vLLM's own code runs on every CPU, this plugin, active only when
``JETRL_ONEDNN_STANDIN=1``, replaces the three oneDNN entry points vLLM calls with pure torch:
the "handler" keeps its own copy of the weight, exactly as oneDNN's packed weights do, so a refit
that does not make vLLM rebuild it leaves the GEMM on stale values. It is registered as a
``vllm.general_plugins`` entry point by the ``*.dist-info`` beside it, found when this folder is
on ``sys.path``/``PYTHONPATH`` (``tests/vllm_fixtures.onednn_standin`` puts it there for the
engines of ``test_vllm_cpu_gemm.py``, its rollback tests included).
"""

from __future__ import annotations

import os

ENV = "JETRL_ONEDNN_STANDIN"
NAMES = ("_supports_onednn", "create_onednn_mm", "onednn_mm")


class PackedWeight:
    """Stands in for vLLM's ``CPUDNNLGEMMHandler``: a private copy of the weight, ``[N, K]``."""

    def __init__(self, weight_kn):
        self.w = weight_kn.t().contiguous().clone()
        self.k, self.n = weight_kn.shape


def create_onednn_mm(weight, primitive_cache_size: int = 128) -> PackedWeight:
    return PackedWeight(weight)


def onednn_mm(handler: PackedWeight, x, bias):
    import torch.nn.functional as F

    return F.linear(x, handler.w.to(x.dtype), bias)


def apply() -> dict:
    """Install the stand-in into ``vllm._custom_ops``; returns what it replaced."""
    from vllm import _custom_ops as ops

    saved = {n: getattr(ops, n) for n in NAMES}
    ops._supports_onednn = True
    ops.create_onednn_mm = create_onednn_mm
    ops.onednn_mm = onednn_mm
    return saved


def revert(saved: dict) -> None:
    from vllm import _custom_ops as ops

    for n, v in saved.items():
        setattr(ops, n, v)


def load() -> None:
    """vLLM general-plugin entry point (runs in every vLLM process)."""
    if os.environ.get(ENV) == "1":
        apply()
