"""NeMo-RL's vLLM refit with our weight quantizer and our parity check (explicit, revertible hook).

NeMo-RL's vLLM worker extension (``VllmInternalWorkerExtension``, both v0.7.0 and main 7ea279a)
hands every streamed batch of BF16 HF weights to ``quantization.fp8.load_weights(weights,
model_runner)``, which quantizes FP8 linears with NeMo-RL's own ``cast_tensor_to_fp8_blockwise``.
That formula equals TE's with power-of-two scales but not with FP32 scales (it divides where TE
multiplies by the reciprocal): the rollout would compute with other weight bytes and scales than
the training forward. `install_refit_hook(settings)` replaces, inside the vLLM worker process:

1. ``fp8.load_weights`` by ours: each weight the recipe runs in FP8 is quantized with
   ``nemo_jetrl.vllm_patch.refit.quantize_state_dict`` (``nemo_jetrl.fp8.quantize_blockwise`` in
   the recipe's scale mode, its guards included) and loaded as ``weight`` + ``weight_scale_inv``
   through the model's own ``load_weights``, as NeMo-RL does; other tensors (norms, embeddings,
   KV scales) pass through unchanged. Which weights are FP8 is asked of the engine too: a weight
   the engine holds in FP8 but the recipe keeps in BF16 (or the reverse) is refused by name.
2. the transports ``update_weights_via_ipc_zmq`` / ``update_weights_from_collective``: they run
   as before, then (``jetrl.refit_parity_check``) every tensor sent in this refit is read back
   with our worker extension's ``jetrl_read_back`` and compared by ``refit.check_parity``
   (FP8 bytes and scales bit for bit; at vLLM tensor_parallel_size > 1 each rank compares its
   own shard of every tensor, ``dense_shards`` / ``expert_shards``; pipeline parallel is
   refused, after receiving the stream); the KV scales sent are compared with what the attention
   layers hold. A difference raises ``ParityError`` naming the tensors, out of the transport,
   so NeMo-RL's driver stops the run instead of rolling out with other weights.
   All-or-nothing (``jetrl.refit_rollback``): the batches stream in one by one, so a refusal in
   batch k comes after batches 1..k-1 were loaded. The transport therefore snapshots the model
   first (``vllm_patch.rollback``: one copy of its tensors, on the GPU if it fits, else in host
   memory; always in host memory when vLLM is colocated with the trainer) and, on any failure
   (our refusal, NeMo-RL's transport returning False, the parity check), restores it and
   verifies it bit for bit before raising: a refused refit leaves the engine exactly as it was. At tensor_parallel_size > 1 the ranks agree first
   (``vllm_patch.rank_vote``): every rank restores when any rank failed.
   On an engine replaying CUDA graphs, tensors the refit rebinds (vLLM 0.20/0.25's MLA
   ``W_UK_T``/``W_UV``) go back into the storage the graphs read (``graph_bindings``).
3. main's transports that do not go through ``fp8.load_weights`` (NCCL reshard, sparse delta,
   checkpoint engine) are refused with a message naming the supported ones.

The hook relies on those names and on the loader calling ``fp8.load_weights`` through the module
attribute; `detect_layout` checks exactly that (from the source of the installed NeMo-RL) and
refuses anything else naming the trees it was tested with. The vLLM plugin entry point
(`load_in_worker`) installs it in NeMo-RL's vLLM processes when ``NEMO_JETRL_NRL_REFIT`` is set
(``refit_hook_env``, put into ``policy.generation.vllm_cfg.env_vars`` by the launcher).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from nemo_jetrl._optional import require
from nemo_jetrl.backends.nemo_rl import kv_wake
from nemo_jetrl.backends.nemo_rl.refit_batches import (
    SentTensors,
    check_refit_parity,
    float32_kv_scales,
    quantize_batch,
)
from nemo_jetrl.backends.nemo_rl.refit_steps import drain_refused, keep_graph_storage, sync_device
from nemo_jetrl.vllm_patch import graph_bindings, rank_vote
from nemo_jetrl.vllm_patch.refit import REFUSED, RefitError
from nemo_jetrl.vllm_patch.rollback import model_device, take_snapshot
from nemo_jetrl.vllm_patch.settings import ENV_VAR as PATCH_ENV
from nemo_jetrl.vllm_patch.settings import PatchSettings

log = logging.getLogger(__name__)
ENV_VAR = "NEMO_JETRL_NRL_REFIT"
FP8_MODULE = "nemo_rl.models.generation.vllm.quantization.fp8"
BACKEND_MODULE = "nemo_rl.models.generation.vllm.vllm_backend"
TESTED = "NeMo-RL v0.7.0 (81aa43d) and main 7ea279a"
TRANSPORTS = ("update_weights_via_ipc_zmq", "update_weights_from_collective")
# main-only transports that load without fp8.load_weights (or without a parity point).
BYPASSING = (
    "nccl_reshard_refit",
    "update_weights_from_decoded_sparse_payload",
    "update_weights_from_checkpoint_engine",
)
# Where NeMo-RL's extension calls its quantizer: main (_load_hf_weights), v0.7.0 (_load_weights).
LOADERS = {"_load_hf_weights": "main-7ea279a", "_load_weights": "v0.7.0"}
MARK = "_jetrl_nrl_refit_state"


class UnsupportedNemoRl(RuntimeError):
    """The installed NeMo-RL's vLLM refit is not the code this hook was written against."""


def refit_hook_env(
    parity: bool, rollback: bool = True, host_snapshot: bool = False
) -> dict[str, str]:
    """vLLM worker env that makes `load_in_worker` install the hook (``jetrl.refit_parity_check``
    decides ``parity``, ``jetrl.refit_rollback`` ``rollback``; ``host_snapshot``: the rollback
    copy in host memory, for vLLM colocated with the trainer, whose refit buffers take GPU
    memory at the same moment)."""
    flags = {"parity": bool(parity), "rollback": bool(rollback), "host_snapshot": host_snapshot}
    return {ENV_VAR: json.dumps(flags)}


def detect_layout(ext: type, fp8_mod: Any) -> str:
    """Which tested tree's refit layout the installed NeMo-RL has ('v0.7.0' / 'main-7ea279a')."""
    problems = []
    params = list(inspect.signature(fp8_mod.load_weights).parameters)
    if params != ["weights", "model_runner"]:
        problems.append(
            f"{FP8_MODULE}.load_weights{tuple(params)} (expected weights, model_runner)"
        )
    missing = [t for t in TRANSPORTS if not callable(getattr(ext, t, None))]
    if missing:
        problems.append(f"VllmInternalWorkerExtension has no {missing}")
    layout = None
    for loader, tree in LOADERS.items():
        fn = ext.__dict__.get(loader)
        if fn is not None and "fp8.load_weights(" in inspect.getsource(fn):
            layout = tree
            break
    if layout is None:
        problems.append(
            "no VllmInternalWorkerExtension loader calls fp8.load_weights(...) (looked in "
            + ", ".join(LOADERS)
            + ")"
        )
    if problems:
        raise UnsupportedNemoRl(
            "the nemo_jetrl refit hook was written against the vLLM refit of "
            f"{TESTED}; the installed NeMo-RL differs: " + "; ".join(problems) + ". Use a tested "
            "NeMo-RL or set jetrl.vllm_patch: false (the rollout then quantizes with NeMo-RL's "
            "own code, off-policy with FP32 scales)"
        )
    return layout  # type: ignore[return-value]


@dataclass
class HookState:
    settings: PatchSettings
    parity: bool
    rollback: bool
    layout: str
    host_snapshot: bool = False
    handle: NrlRefitHandle | None = None

    @property
    def refused(self) -> str:
        """How a refusal opens: without rollback, earlier batches of the refit stay loaded."""
        if self.rollback:
            return REFUSED  # true once the wrapper has rolled the engine back
        return (
            "refit refused in a streamed batch; the batches before it stay loaded "
            "(jetrl.refit_rollback is false): stop the run"
        )


def _make_load_weights(state: HookState) -> Any:
    def load_weights(weights: Any, model_runner: Any) -> None:
        sent = getattr(model_runner, "_jetrl_sent", None)
        if sent is not None and sent.error is not None:
            return  # this refit is already refused (main's transport goes on receiving)
        fp8_mod = require(FP8_MODULE, feature="the NeMo-RL refit hook")
        cfg = getattr(fp8_mod, "global_fp8_config", None)
        pow2 = getattr(cfg, "use_weight_pow2_scale", None)
        try:
            if getattr(cfg, "is_mx", False):
                raise RefitError("NeMo-RL's MXFP8 refit: nemo_jetrl runs 128x128 block FP8 only")
            if pow2 is not None and bool(pow2) != state.settings.pow2_weight_scales:
                raise RefitError(
                    "policy.generation.vllm_cfg.pow2_weight_scaling_factors="
                    f"{bool(pow2)} but the recipe's weights use "
                    f"{'pow2' if state.settings.pow2_weight_scales else 'FP32'} scales: align them"
                )
            batch = quantize_batch(
                list(weights), model_runner.model, state.settings, sent, refused=state.refused
            )
        except RefitError as exc:
            if sent is None:
                raise
            # Recorded, not raised: on a raise NeMo-RL's transport stops receiving (v0.7.0's
            # IPC loop leaves without its ACK, so the trainer times out 120 s later; the
            # collective consumer leaves a broadcast the trainer ranks then wait on for ever).
            # The stream goes on, nothing more is loaded, and the wrapper raises it after.
            sent.error = exc
            return
        model_runner.model.load_weights(batch)

    setattr(load_weights, MARK, state)
    return load_weights


def _make_transport(name: str, original: Any, state: HookState) -> Any:
    @functools.wraps(original)
    def transport(self: Any, *args: Any, **kwargs: Any) -> Any:
        runner = self.model_runner
        # TP ranks check their own shards and vote (rank_vote); pipeline stages cannot
        pp = getattr(self.vllm_config.parallel_config, "pipeline_parallel_size", 1)
        checked = rank_vote.checks_on(parity=state.parity, rollback=state.rollback)
        if why := rank_vote.stage_problem(pp, checked):  # every rank refuses: none votes
            drain_refused(self, original, (args, kwargs), f"vLLM pipeline_parallel_size={why}")
        sent = runner._jetrl_sent = SentTensors(keep=state.parity)
        snap = bound = None
        ok, failure = False, None
        try:
            step = "its attention KV scales could not be widened to float32"
            try:  # whatever fails here, every rank drains its stream and votes (rank_vote.py)
                float32_kv_scales(runner.model)  # before the snapshot and graph bindings see them
                step = "its rollback snapshot could not be taken"
                host = state.host_snapshot
                snap = take_snapshot(runner.model, runner, host=host) if state.rollback else None
                if graph_bindings.captures_cuda_graphs(
                    self.vllm_config, model_device(runner.model)
                ):
                    step = "the storage its CUDA graphs read could not be recorded"
                    bound = graph_bindings.record(runner.model, runner)
            except Exception as exc:  # out of memory on this rank alone, say
                sent.error = RefitError(
                    f"refit refused on this rank before loading: {step} "
                    f"({type(exc).__name__}: {exc}); NeMo-RL's stream was received and none "
                    "of its weights loaded"
                )
            if snap is not None:
                log.info("%s: snapshot %.0f MiB on %s", name, snap.nbytes / 2**20, snap.device)
            # the snapshot's copies are queued on the default stream, behind any in-flight
            # forward (async scheduling); NeMo-RL's loads land on side streams that do not
            # wait for it: the copies finish first or the snapshot holds new weights
            sync_device(runner.model)
            ok = original(self, *args, **kwargs)
            # NeMo-RL's collective consumer copies on a side stream it never joins: let every
            # copy land before the parity read or a restore reads or writes the weights
            sync_device(runner.model)
            keep_graph_storage(runner.model, bound, sent, ok)
            if sent.error is not None:
                raise sent.error
            if ok and state.parity:
                rep = runner._jetrl_last_parity = check_refit_parity(self, sent)
                print(
                    f"nemo_jetrl: refit parity held: {rep.compared} tensors identical to the "
                    f"trainer's ({rep.fp8} FP8 weights and scales byte for byte)",
                    flush=True,
                )
        except Exception as exc:
            if not state.rollback:
                raise
            failure = exc
        finally:
            runner._jetrl_sent = None
        try:
            if state.rollback:  # all-or-nothing over the engine's ranks
                sync_device(runner.model)
                ok = rank_vote.settle(name, self, snap, failure, ok)
            if ok:  # put back after vLLM's KV-cache wake-up resets them (kv_wake.py)
                kv_wake.keep_kv_scales(runner, sent.kv)
            return ok
        finally:
            if snap is not None:
                # A raised error's traceback keeps settle's frame, and the snapshot with it: its
                # copies go now, and a GPU one's blocks leave torch's cache before the KV
                # cache's wake_up (vLLM's CuMemAllocator maps its own memory) and the rollout.
                snap.modules.clear()
                if snap.device.type == "cuda":
                    import torch

                    torch.cuda.empty_cache()

    setattr(transport, MARK, state)
    return transport


def _make_refusal(name: str) -> Any:
    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedNemoRl(
            f"{name}: this refit transport loads weights without NeMo-RL's fp8.load_weights, "
            "so the rollout would not get the trainer's FP8 bytes. With nemo_jetrl use the IPC "
            f"(colocated) or collective (non-colocated) refit: {', '.join(TRANSPORTS)}"
        )

    setattr(refused, MARK, True)
    return refused


@dataclass
class NrlRefitHandle:
    """What `install_refit_hook` replaced; ``revert()`` puts NeMo-RL's functions back."""

    layout: str
    _patches: list[tuple[Any, str, Any, Any]]
    _reverted: bool = False

    @property
    def active(self) -> bool:
        return not self._reverted and all(getattr(o, n) is new for o, n, _, new in self._patches)

    def revert(self) -> None:
        if self._reverted:
            return
        for owner, name, original, _ in reversed(self._patches):
            setattr(owner, name, original)
        self._reverted = True

    def __enter__(self) -> NrlRefitHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.revert()


def install_refit_hook(
    settings: PatchSettings,
    *,
    parity: bool = True,
    rollback: bool = True,
    host_snapshot: bool = False,
) -> NrlRefitHandle:
    """Hook NeMo-RL's vLLM refit in this process (see the module docstring); idempotent."""
    fp8_mod = require(FP8_MODULE, feature="the NeMo-RL refit hook")
    backend = require(BACKEND_MODULE, feature="the NeMo-RL refit hook")
    ext = backend.VllmInternalWorkerExtension
    current = getattr(fp8_mod.load_weights, MARK, None)
    if current is not None:
        flags = (current.settings, current.parity, current.rollback, current.host_snapshot)
        same = flags == (settings, parity, rollback, host_snapshot)
        if same and current.handle:
            return current.handle
        raise RuntimeError(
            "the nemo_jetrl NeMo-RL refit hook is already installed with other settings; "
            "revert that handle first"
        )
    state = HookState(settings, parity, rollback, detect_layout(ext, fp8_mod), host_snapshot)
    patches = [(fp8_mod, "load_weights", fp8_mod.load_weights, _make_load_weights(state))]
    for name in TRANSPORTS:
        patches.append(
            (ext, name, ext.__dict__[name], _make_transport(name, ext.__dict__[name], state))
        )
    owners = [ext, getattr(backend, "VllmCheckpointEngineMixin", None)]
    for owner in filter(None, owners):
        for name in BYPASSING:
            if name in owner.__dict__:
                patches.append((owner, name, owner.__dict__[name], _make_refusal(name)))
    runner_cls = kv_wake.gpu_model_runner_class()  # vLLM resets FP8 KV scales on wake-up
    if runner_cls is not None:
        wake = runner_cls.__dict__["init_fp8_kv_scales"]
        patches.append((runner_cls, "init_fp8_kv_scales", wake, kv_wake.wake_wrapper(wake)))
    for owner, name, _, new in patches:
        setattr(owner, name, new)
    handle = NrlRefitHandle(state.layout, patches)
    if not handle.active:  # verified in effect: every replaced attribute is ours
        handle.revert()
        raise UnsupportedNemoRl("the NeMo-RL refit hook did not take effect; reverted")
    state.handle = handle
    return handle


_PLUGIN_HANDLE: NrlRefitHandle | None = None


def load_in_worker() -> None:
    """``vllm.general_plugins`` entry point: installs the hook when ``NEMO_JETRL_NRL_REFIT`` is
    set (with the patch settings from ``NEMO_JETRL_VLLM_PATCH``); raises rather than skip."""
    global _PLUGIN_HANDLE
    text = os.environ.get(ENV_VAR)
    if not text:
        return
    try:
        flags = json.loads(text)
        parity, rollback, host = flags["parity"], flags["rollback"], flags["host_snapshot"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(
            f'{ENV_VAR}={text!r}: expected {{"parity": true|false, "rollback": true|false, '
            f'"host_snapshot": true|false}} ({exc})'
        ) from None
    patch = os.environ.get(PATCH_ENV)
    if not patch:
        raise RuntimeError(
            f"{ENV_VAR} is set but {PATCH_ENV} is not: the refit hook quantizes with the vLLM "
            "patch's settings; start vLLM through nemo_jetrl's NeMo-RL launcher"
        )
    _PLUGIN_HANDLE = install_refit_hook(
        PatchSettings.from_json(patch),
        parity=bool(parity),
        rollback=bool(rollback),
        host_snapshot=bool(host),
    )
