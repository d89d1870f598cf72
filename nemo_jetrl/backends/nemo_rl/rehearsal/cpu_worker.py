"""The rehearsal's vLLM plugin: what NeMo-RL's vLLM generation worker needs a GPU for, replaced
on vLLM's CPU build, in every vLLM process of a rehearsal and nowhere else.

It is a ``vllm.general_plugins`` entry point (``nemo_jetrl_rehearsal``, pyproject.toml) that
does nothing unless ``NEMO_JETRL_REHEARSAL`` holds its JSON, which only ``jetrl rehearse`` writes
into ``policy.generation.vllm_cfg.env_vars``. vLLM runs general plugins in each of its processes
(the Ray actor that owns the engine, and the worker process vLLM's CPU build spawns) before it
builds the model. Each substitute below names the call it replaces and why it cannot run here:

``sleep_mode``
    NeMo-RL starts a colocated engine with ``enable_sleep_mode=True``. vLLM's CPU platform
    refuses that (``is_sleep_mode_available``), and its worker's weight and KV-cache loads then go
    through CUDA's virtual-memory pool (``CuMemAllocator``). Here the platform accepts it and the
    worker starts with it off: vLLM's ``CPUWorker.sleep``/``wake_up`` are already no-ops, the
    weights stay in host memory.
``bind_numa``
    NeMo-RL's ``VllmInternalWorkerExtension.bind_numa`` pins the worker to its GPU's NUMA node
    (``torch.cuda.current_device``): no GPU, nothing to pin; answers False ("not bound").
``report_device_id``
    The GPU's UUID, which names the refit's ZMQ socket: here the host and the rehearsal's driver
    pid (where the CPU policy binds it), so concurrent rehearsals on one host stay apart.
``fp8_patches``
    NeMo-RL's ``init_fp8`` patches vLLM in the actor's process; on a GPU with one worker vLLM
    runs there (and here too, with ``uni_executor``). Where a worker runs in another process all
    the same, NeMo-RL's own ``init_fp8`` (which applies its patches with one worker) runs again
    there, with the actor's settings (in the JSON).
``uni_executor``
    NeMo-RL starts a one-worker engine with ``distributed_executor_backend=None`` and
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so on a GPU vLLM's ``uni`` executor runs the model in
    the Ray actor's own process. vLLM 0.20's CPU platform turns ``uni`` into ``mp`` whatever that
    setting says and spawns the worker: a second interpreter importing torch and vLLM (~10 s of
    each engine start on a 2-core CPU) that the cluster does not have. Here ``uni`` is kept when
    multiprocessing is off, as vLLM's CPU platform itself does from 0.25 on; only engines where
    the platform made that change report it.
``device``
    NeMo-RL's extension reads ``worker.device``; vLLM's ``CPUWorker`` has none: ``cpu``.
``ipc_buffer``
    The refit's receiver (NeMo-RL's ``update_weights_via_ipc_zmq``) maps each packed buffer from
    a CUDA IPC handle (``rebuild_cuda_tensor_from_ipc``) and syncs the CUDA stream before its
    ACK. Here the rehearsal's CPU policy (`policy.py`) writes the buffer to a shared-memory file
    and sends ``(path,)`` as the handle; the receiver maps that file, and the stream sync is a
    no-op. NeMo-RL's socket, messages, slicing, ``_load_weights`` and ACKs are unchanged.
``bf16_weights``
    vLLM's CPU build moves a BF16 linear's weight into a packed oneDNN copy and empties
    ``layer.weight``, so NeMo-RL's refit (``model.load_weights``) could not land in it; here the
    weight stays in place (vLLM's own no-oneDNN branch: ``torch.nn.functional.linear``), as on
    a GPU.
``vllm_block_fp8``
    Only for a recipe served by vLLM's own block-FP8 kernel (``fp8_rollout``: no nemo_jetrl
    patch in the worker): vLLM's GPU GEMMs have no CPU build (0.20 has no CPU entry in its
    kernel registry: ``KeyError: PlatformEnum.CPU``). vLLM's kernel class with the reference
    GEMM stands in, appended last (`vllm_block_fp8`); vLLM's quantizer runs as on a GPU.

`load_in_worker` keeps the handle in `_HANDLE`; `RehearsalHandle.active` says whether every
replacement is still in place and `revert` puts vLLM's and NeMo-RL's own back.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

ENV_VAR = "NEMO_JETRL_REHEARSAL"
SUBSTITUTES = (
    "sleep_mode", "bind_numa", "report_device_id", "fp8_patches", "device", "ipc_buffer",
    "bf16_weights", "vllm_block_fp8", "uni_executor",
)  # fmt: skip


class _NoStream:
    """``torch.cuda.current_stream()`` on CPU: nothing to synchronize."""

    def synchronize(self) -> None:
        pass


def buffer_from_handle(handle: Any, device_id: Any = None) -> Any:
    """The receiver's side of the IPC substitute: the file the CPU sender wrote, mapped."""
    import torch

    return torch.from_file(handle[0], shared=False, size=os.path.getsize(handle[0]),
                           dtype=torch.uint8)  # fmt: skip


def _keep_bf16_weight(layer: Any, remove_weight: bool) -> None:
    import torch

    layer.cpu_linear = torch.nn.functional.linear


@dataclass
class RehearsalHandle:
    """What `install` replaced: (owner, attribute, original, ours) for each, and registrations
    as (still in place?, undo) pairs."""

    patches: list[tuple[Any, str, Any, Any]] = field(default_factory=list)
    applied: tuple[str, ...] = ()  # grows by "uni_executor" when an engine's config kept it
    registrations: list[tuple[Any, Any]] = field(default_factory=list)
    _reverted: bool = False

    @property
    def active(self) -> bool:
        return (
            not self._reverted
            and all(vars(o).get(n) is new for o, n, _, new in self.patches)  # a classmethod too
            and all(in_place() for in_place, _ in self.registrations)
        )

    def revert(self) -> None:
        if self._reverted:
            return
        for _, undo in reversed(self.registrations):
            undo()
        for owner, name, original, _ in reversed(self.patches):
            setattr(owner, name, original)
        self._reverted = True


def device_id(driver_pid: int | None = None) -> str:
    """The rehearsal's stand-in for a GPU UUID (NeMo-RL names the refit's ZMQ socket by it):
    one per rehearsal (its driver's pid), so two rehearsals on one host never share a socket."""
    return f"rehearsal-{socket.gethostname()}-{driver_pid or os.getpid()}"


@contextlib.contextmanager
def _vllm_own_moe_method() -> Any:
    """vLLM's own ``Fp8MoEMethod`` in its module slot while NeMo-RL's ``init_fp8`` patches it.
    On a GPU NeMo-RL patches before vLLM loads plugins (``run_engine_core``, or the first
    ``collective_rpc`` of a Ray executor), so our experts method, installed later, subclasses
    the patched class and keeps its own ``process_weights_after_loading``; here the patches
    come after our plugin and would land on our class (NeMo-RL's MoE conversion then asks for
    vLLM's FP8 MoE backend: ``AttributeError: 'NoneType' object has no attribute 'value'``)."""
    from nemo_jetrl.vllm_patch import experts

    ours = experts.installed_moe_method()
    mod = experts._fp8_module()
    if ours is not None:
        setattr(mod, experts.SLOT, ours._jetrl_original)
    try:
        yield
    finally:
        if ours is not None:
            setattr(mod, experts.SLOT, ours)


def install(settings: dict[str, Any]) -> RehearsalHandle:
    """Replace, in this process, what NeMo-RL's vLLM worker needs a GPU for (module docstring).
    ``settings``: the JSON of `ENV_VAR` (``vllm_cfg``, ``model``, ``model_parallel_size``,
    ``driver_pid``)."""
    driver_pid = int(settings["driver_pid"])  # the CPU policy's process names the refit socket
    from nemo_rl.models.generation.vllm import vllm_backend
    from vllm.platforms import current_platform
    from vllm.v1.worker.cpu_worker import CPUWorker

    from nemo_jetrl.vllm_patch.uni_executor import keep_uni_executor

    ext = vllm_backend.VllmInternalWorkerExtension
    platform = type(current_platform)
    init, init_device = CPUWorker.__init__, CPUWorker.init_device

    def cpu_init(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        vllm_config.model_config.enable_sleep_mode = False  # no CUDA memory pool on CPU
        init(self, vllm_config, *args, **kwargs)

    def cpu_init_device(self: Any) -> None:
        import torch

        init_device(self)
        self.device = torch.device("cpu")

    import torch
    from vllm.model_executor.layers import utils as layer_utils

    handle = RehearsalHandle()

    def kept_uni() -> None:
        if "uni_executor" not in handle.applied:
            handle.applied += ("uni_executor",)

    ours = [
        (platform, "is_sleep_mode_available", lambda self: True),
        (platform, "check_and_update_config", keep_uni_executor(platform, kept_uni)),
        (vllm_backend, "rebuild_cuda_tensor_from_ipc", buffer_from_handle),
        (torch.cuda, "current_stream", lambda *a, **k: _NoStream()),
        (layer_utils, "dispatch_cpu_unquantized_gemm", _keep_bf16_weight),
        (CPUWorker, "__init__", cpu_init),
        (CPUWorker, "init_device", cpu_init_device),
        (ext, "bind_numa", lambda self: False),
        (ext, "report_device_id", lambda self: device_id(driver_pid)),
    ]
    patches = [(o, n, o.__dict__.get(n, getattr(o, n)), new) for o, n, new in ours]
    for owner, name, _, new in patches:
        setattr(owner, name, new)
    applied = ["sleep_mode", "device", "bind_numa", "report_device_id", "ipc_buffer",
               "bf16_weights"]  # fmt: skip
    vllm_cfg = settings.get("vllm_cfg") or {}
    if vllm_cfg.get("precision") == "fp8":
        from nemo_rl.models.generation.vllm.quantization import fp8

        if not fp8.fp8_patches_applied:  # a spawned worker: NeMo-RL's own call, once more
            # (with one worker per engine init_fp8 applies its patches in this process itself)
            with _vllm_own_moe_method():
                fp8.init_fp8(vllm_cfg, settings["model"], int(settings["model_parallel_size"]))
            applied.append("fp8_patches")
    from nemo_jetrl.vllm_patch.settings import ENV_VAR as PATCH_ENV

    registrations = []
    if vllm_cfg.get("precision") == "fp8" and not os.environ.get(PATCH_ENV):
        from nemo_jetrl.backends.nemo_rl.rehearsal import vllm_block_fp8

        _, undo = vllm_block_fp8.register()
        registrations.append((vllm_block_fp8.registered, undo))
        applied.append("vllm_block_fp8")
    handle.patches, handle.registrations = patches, registrations
    handle.applied = tuple(applied) + handle.applied
    if not handle.active:  # verified in effect
        handle.revert()
        raise RuntimeError("nemo_jetrl rehearsal: the CPU substitutes did not take effect")
    return handle


_HANDLE: RehearsalHandle | None = None


def load_in_worker() -> None:
    """``vllm.general_plugins`` entry point: installs the substitutes when `ENV_VAR` is set;
    idempotent (vLLM may load plugins more than once in a process)."""
    global _HANDLE
    text = os.environ.get(ENV_VAR)
    if not text or (_HANDLE is not None and _HANDLE.active):
        return
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENV_VAR}={text!r} is not JSON ({exc})") from None
    _HANDLE = install(settings)
    print(
        f"nemo_jetrl rehearsal: CPU substitutes in vLLM process {os.getpid()}: "
        + ", ".join(_HANDLE.applied),
        flush=True,
    )
