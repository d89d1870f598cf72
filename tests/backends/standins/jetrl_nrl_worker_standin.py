"""TEST STAND-IN plugin for NeMo-RL's vLLM worker on vLLM's CPU build (active only when
``JETRL_NRL_WORKER_STANDIN`` holds a JSON object).

vLLM 0.20's CPU build spawns its worker process (0.25's runs it in the engine's process), so
what NeMo-RL does to the process that owns vLLM before the engine starts has to happen there at
start-up; vLLM runs every ``vllm.general_plugins`` entry point in each of its processes before
it builds the model (the test records what this changes in its own process and undoes it):

* NeMo-RL's own ``apply_fp8_patches(None, FP8Config(...))`` (the call NeMo-RL itself makes on each
  vLLM worker when TP > 1), with the config from the JSON (``fp8``);
* stand-ins for what needs a GPU: CUDA IPC handles (``rebuild_cuda_tensor_from_ipc`` maps the
  file the test's sender wrote), ``torch.cuda.current_stream()`` (no-op synchronize), the GPU UUID
  naming the ZMQ socket (``report_device_id``) and ``worker.device`` (the CPU worker has none);
* with ``keep_unquantized_weights``: BF16 linears keep their weight in place (vLLM's own
  no-oneDNN branch), as on a GPU.

The ``*.dist-info`` beside this file registers it, together with nemo_jetrl's own
``nemo_jetrl.backends.nemo_rl.vllm_refit:load_in_worker`` (what ``pyproject.toml`` registers when
the package is installed), when this folder is on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os

ENV = "JETRL_NRL_WORKER_STANDIN"


class NoStream:
    """Stands in for ``torch.cuda.current_stream()`` on CPU."""

    def synchronize(self) -> None:
        pass


def tensor_from_handle(handle, device_id=None):
    """Receiver side of the CUDA IPC stand-in: the sender wrote the packed buffer to a file."""
    import torch

    return torch.from_file(handle[0], size=os.path.getsize(handle[0]), dtype=torch.uint8)


def load() -> None:
    text = os.environ.get(ENV)
    if not text:
        return
    cfg = json.loads(text)
    import torch
    from nemo_rl.models.generation.vllm import vllm_backend
    from nemo_rl.models.generation.vllm.quantization import fp8
    from vllm.v1.worker.cpu_worker import CPUWorker

    if not fp8.fp8_patches_applied:
        fp8.apply_fp8_patches(None, fp8.FP8Config(**cfg["fp8"]))
    vllm_backend.rebuild_cuda_tensor_from_ipc = tensor_from_handle
    torch.cuda.current_stream = lambda *a: NoStream()
    device_id = cfg["device_id"]
    vllm_backend.VllmInternalWorkerExtension.report_device_id = lambda self: device_id
    init_device = CPUWorker.init_device

    def init_cpu_device(self):
        init_device(self)
        self.device = torch.device("cpu")

    CPUWorker.init_device = init_cpu_device
    if cfg.get("keep_unquantized_weights"):
        # vLLM's own fallback branch of dispatch_cpu_unquantized_gemm (a CPU without oneDNN):
        # the BF16 weight stays in place, as on a GPU, so NeMo-RL's plain model.load_weights can
        # refit it (the oneDNN branch empties it for a packed copy only a layerwise reload fills).
        from vllm.model_executor.layers import utils as layer_utils

        def keep_weight(layer, remove_weight):
            layer.cpu_linear = torch.nn.functional.linear

        layer_utils.dispatch_cpu_unquantized_gemm = keep_weight
