"""Steps of our wrapped NeMo-RL vLLM refit transport (`vllm_refit`) around NeMo-RL's own:
draining a refused refit's stream, keeping CUDA-graph storage, waiting for the device."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from nemo_jetrl.backends.nemo_rl.refit_batches import SentTensors
from nemo_jetrl.vllm_patch import graph_bindings
from nemo_jetrl.vllm_patch.refit import RefitError

log = logging.getLogger(__name__)


def drain_refused(worker: Any, original: Any, call: tuple[Any, Any], why: str) -> NoReturn:
    """Receive NeMo-RL's stream, load none of its weights (our ``load_weights`` skips a refused
    refit; its post-load steps still run), raise ``why``: raised before, the trainer waited."""
    runner = worker.model_runner
    sent = runner._jetrl_sent = SentTensors(keep=False)
    sent.error = RefitError(why)
    try:
        original(worker, *call[0], **call[1])
    finally:
        runner._jetrl_sent = None
    raise sent.error


def keep_graph_storage(model: Any, bound: Any, sent: SentTensors, ok: bool) -> None:
    """Rebound tensors back where the captured CUDA graphs read them (`graph_bindings`), also
    after a refusal (NeMo-RL's stream end still runs vLLM's post-processing); a refusal's own
    error outranks a failure here (the rollback restores the bindings too)."""
    if bound is None or not (ok or sent.error is not None):
        return
    try:
        graph_bindings.keep_in_place(model, bound)
    except RefitError:
        if sent.error is None:
            raise
        log.exception("after the refused refit, graph storage could not be kept")


def sync_device(model: Any) -> None:
    """Wait for every stream of ``model``'s CUDA device (nothing on a CPU engine)."""
    p = next(iter(model.parameters()), None)
    if p is not None and p.is_cuda:
        import torch

        torch.cuda.synchronize(p.device)
