"""Shared set-up of the `vllm` test modules (real vLLM CPU build, scripts/test_vllm.sh)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


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
