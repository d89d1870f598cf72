"""A ``vllm.LLM`` started the way NeMo-RL's ``VllmGenerationWorker`` starts it, and NeMo-RL's real
colocated refit into it: the engine set-up of test_nemo_rl_refit_vllm.py (a tiny dense Llama) and
test_nemo_rl_refit_vllm_moe.py (a tiny Qwen3-MoE), each of which starts one engine with it.

``nemo_rl_engine``: NeMo-RL's own ``init_fp8`` (its vLLM patches and engine kwargs), its
``VllmInternalWorkerExtension`` as the worker extension, engine core in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), our vLLM patch applied and our refit hook armed.
``_refit_via_nemo_rl``: NeMo-RL's real sender (``stream_weights_via_ipc_zmq_impl``) over a real
ZMQ socket into its real receiver (``update_weights_via_ipc_zmq``). Stand-ins only for what needs a
GPU (CUDA IPC handles as files, ``torch.cuda.current_stream()``, the GPU UUID naming the socket,
``worker.device``: ``standins/jetrl_nrl_worker_standin.py``); see test_nemo_rl_refit_vllm.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import threading
import uuid
from pathlib import Path

import pytest
import torch
from nemo_rl_upstream import expected_refit_layout, nemo_rl_vllm_modules

BUFFER_BYTES = 1 << 20  # several packed batches for this model
ENGINE_KWARGS = dict(
    dtype="bfloat16", max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=0
)


class _NoStream:
    """Stand-in for torch.cuda.current_stream() on CPU."""

    def synchronize(self) -> None:
        pass


STANDINS = Path(__file__).resolve().parent / "standins"


@contextlib.contextmanager
def nemo_rl_engine(
    d: Path, ipc_dir: Path, settings, vllm_cfg: dict | None = None, keep_bf16: bool = False
):
    """(llm, device_id): ``vllm.LLM`` on model dir ``d`` started as NeMo-RL's worker starts it
    (module docstring; ``vllm_cfg``: more ``policy.generation.vllm_cfg`` keys for NeMo-RL's
    ``init_fp8``; ``keep_bf16``: BF16 linears keep their weight, see the stand-in plugin), our
    patch with ``settings``, our hook armed; all undone on exit."""
    from vllm_fixtures import vllm_cpu_env

    from nemo_jetrl.vllm_patch.shutdown import shutdown_engine

    vllm_backend, fp8, utils = nemo_rl_vllm_modules()
    from nemo_jetrl.backends.nemo_rl import vllm_refit
    from nemo_jetrl.vllm_patch import apply_patches

    mp = pytest.MonkeyPatch()
    with vllm_cpu_env():
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as NeMo-RL's VllmGenerationWorker
        counter = iter(range(1 << 30))

        def handle_from_tensor(t):  # sender side: stand-in for a CUDA IPC handle
            path = str(ipc_dir / f"buf{next(counter)}.bin")
            t.detach().cpu().numpy().tofile(path)
            return (path,)

        mp.setattr(utils, "get_handle_from_tensor", handle_from_tensor)
        mp.setattr(torch.cuda, "current_stream", lambda *a: _NoStream())
        device_id = f"jetrl-test-{uuid.uuid4().hex[:8]}"
        cfg = {"precision": "fp8", "kv_cache_dtype": "auto", "async_engine": False}
        nrl_kwargs = fp8.init_fp8(
            {**cfg, **(vllm_cfg or {})}, str(d), 1
        )  # NeMo-RL's own patches and kwargs
        # vLLM's CPU build spawns its worker: the stand-in plugin applies NeMo-RL's fp8 patches
        # there (its apply_fp8_patches) and the CUDA stand-ins; nemo_jetrl's refit entry point
        # installs our hook there, armed by the env the launcher writes.
        standin = {
            "fp8": dataclasses.asdict(fp8.global_fp8_config),
            "device_id": device_id,
            "keep_unquantized_weights": keep_bf16,
        }
        mp.setenv("JETRL_NRL_WORKER_STANDIN", json.dumps(standin))
        # The stand-in plugin also runs in this process (vLLM loads plugins here too, and 0.25's
        # CPU worker lives here): record what it replaces so that mp.undo() restores it.
        from vllm.model_executor.layers import utils as layer_utils
        from vllm.v1.worker.cpu_worker import CPUWorker

        for owner, name in (
            (layer_utils, "dispatch_cpu_unquantized_gemm"),
            (vllm_backend, "rebuild_cuda_tensor_from_ipc"),
            (vllm_backend.VllmInternalWorkerExtension, "report_device_id"),
            (CPUWorker, "init_device"),
        ):
            mp.setattr(owner, name, getattr(owner, name))
        # vLLM loads plugins once per process, and 0.25's CPU worker lives in this one: without
        # this, a second engine here (the next module's) would start without the stand-in and
        # our hook, which the first engine's exit undid.
        import vllm.plugins

        mp.setattr(vllm.plugins, "plugins_loaded", False)
        mp.setenv("PYTHONPATH", os.pathsep.join([str(STANDINS), os.environ.get("PYTHONPATH", "")]))
        mp.syspath_prepend(str(STANDINS))
        for k, v in vllm_refit.refit_hook_env(True).items():
            mp.setenv(k, v)
        patch = apply_patches(settings)  # NEMO_JETRL_VLLM_PATCH reaches the worker process
        from vllm import LLM

        llm = LLM(
            model=str(d),
            load_format="dummy",
            worker_extension_cls=f"{vllm_backend.__name__}.VllmInternalWorkerExtension",
            **{**ENGINE_KWARGS, **nrl_kwargs},
        )
        try:
            active, layout = llm.collective_rpc(_hook_status)[0]
            assert active and layout in expected_refit_layout()
            yield llm, device_id
        finally:
            if vllm_refit._PLUGIN_HANDLE is not None:  # vLLM ran the plugins here too
                vllm_refit._PLUGIN_HANDLE.revert()
            patch.revert()
            for p in fp8.fp8_state.vllm_patches:
                p.stop()
            fp8.fp8_state.vllm_patches.clear()
            fp8.fp8_patches_applied = False
            llm.collective_rpc(_close_receiver_socket)
            shutdown_engine(llm)
            del llm
            gc.collect()
            mp.undo()
            # NeMo-RL's sender binds ipc:///tmp/<device id>.sock and leaves the file (on a
            # cluster the id is the GPU's, one name per GPU; here a new one per engine)
            Path(f"/tmp/{device_id}.sock").unlink(missing_ok=True)


def _close_receiver_socket(self):
    """NeMo-RL's receiver keeps its ZMQ socket open for the worker's life. Close it (and its
    context) here: otherwise garbage collection later runs the context's destructor, which waits
    for that socket forever, and a later test hangs (seen in the main-7ea279a tier)."""
    sock = getattr(self, "zmq_socket", None)  # set on the worker by NeMo-RL's maybe_init_zmq
    if sock is not None:
        sock.close(linger=0)
    ctx = getattr(self, "zmq_context", None)
    if ctx is not None:
        ctx.term()  # returns at once now; a later destructor finds it closed


def _hook_status(self):
    from nemo_jetrl.backends.nemo_rl import vllm_refit

    h = vllm_refit._PLUGIN_HANDLE
    return (h.active, h.layout) if h is not None else None


def _refit_via_nemo_rl(
    llm,
    device_id: str,
    weights: dict[str, torch.Tensor],
    *,
    timeout_ms: int = 120000,
    info: dict | None = None,
) -> bool:
    """NeMo-RL's colocated refit: its sender in a thread, its receiver through collective_rpc.
    Returns the receiver's result; a sender error is raised unless the receiver failed too
    (v0.7.0's receiver then never acknowledges, and the sender times out after ``timeout_ms``)."""
    import zmq
    from nemo_rl.models.policy.utils import stream_weights_via_ipc_zmq_impl

    # NeMo-RL's metadata step (policy.prepare_refit_info -> the workers' prepare_refit_info).
    info = info or {k: (v.shape, v.dtype) for k, v in weights.items()}
    llm.collective_rpc("prepare_refit_info", args=(info,))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc:///tmp/{device_id}.sock")  # the address the vLLM side connects to
    errors: list[BaseException] = []

    def send() -> None:
        try:
            stream_weights_via_ipc_zmq_impl(iter(weights.items()), BUFFER_BYTES, sock, 0, "test")
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    try:
        results = llm.collective_rpc("update_weights_via_ipc_zmq")
    finally:
        t.join(timeout=timeout_ms / 1000 + 60)
        sock.close()
        ctx.term()
    if all(results):
        assert not errors, errors
    return all(results)


def _read_fp8(self, names):  # safetensors bytes: tensors do not cross vLLM's RPC as they are
    from nemo_jetrl.vllm_patch.worker_ext import pack, read_back

    return pack({k: t.clone() for k, t in read_back(self, names)})


def _last_parity(self):
    return self.model_runner._jetrl_last_parity
