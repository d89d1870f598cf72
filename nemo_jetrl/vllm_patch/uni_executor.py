"""vLLM's ``uni`` executor kept on its CPU builds: a one-worker engine's model in the caller.

With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and one worker, vLLM runs the engine core and its only
worker in the caller's process (the ``uni`` executor). NeMo-RL's generation worker runs every
TP=1 engine so on a GPU (``distributed_executor_backend=None``, multiprocessing off). vLLM 0.20's
CPU platform turns ``uni`` into ``mp`` in ``check_and_update_config`` whatever multiprocessing
says, and then spawns the worker: a second interpreter importing torch and vLLM (~10 s of each
engine start on 2 cores) that the GPU path does not have. vLLM 0.25+ keep ``uni`` themselves
with multiprocessing off, so there the rule never fires.

`keep_uni_executor` builds a replacement for the platform's classmethod: the platform's own
method still runs first, with every other setting it makes, and only that one change is undone,
only when multiprocessing is off. Installing it is the caller's explicit act, reverted by the
caller (the rehearsal's worker handle; the vLLM tier's `vllm_cpu_env`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"  # NeMo-RL's generation worker sets it to "0"


def keep_uni_executor(platform: type, on_kept: Callable[[], None] | None = None) -> Any:
    """A ``check_and_update_config`` classmethod for ``platform`` that keeps a one-worker
    engine's ``uni`` executor when multiprocessing is off (module docstring); ``on_kept()`` is
    called each time it undoes the platform's change."""
    check = platform.__dict__["check_and_update_config"].__func__

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        parallel = vllm_config.parallel_config
        before = parallel.distributed_executor_backend
        check(cls, vllm_config)
        if (
            before == "uni"
            and parallel.distributed_executor_backend == "mp"
            and os.environ.get(MULTIPROCESSING) == "0"
        ):
            parallel.distributed_executor_backend = "uni"
            if on_kept is not None:
                on_kept()

    return classmethod(check_and_update_config)
