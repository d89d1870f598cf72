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
   (FP8 bytes and scales bit for bit); the KV scales sent are compared with what the attention
   layers hold. A difference raises ``ParityError`` naming the tensors, out of the transport, so
   NeMo-RL's driver stops the run instead of rolling out with other weights.
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
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_jetrl._optional import require
from nemo_jetrl.vllm_patch import compat
from nemo_jetrl.vllm_patch.refit import (
    SCALE_SUFFIX,
    ParityError,
    ParityReport,
    QuantizedStateDict,
    RefitError,
    check_parity,
    is_fp8_weight,
    quantize_state_dict,
)
from nemo_jetrl.vllm_patch.settings import ENV_VAR as PATCH_ENV
from nemo_jetrl.vllm_patch.settings import PatchSettings
from nemo_jetrl.vllm_patch.worker_ext import JetRLWorkerExtension, resolve_hf_name

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
KV_NAME = re.compile(r"^(?P<layer>.+\.self_attn)\.(?:attn\.)?(?P<t>[qkv])_scale$")


class UnsupportedNemoRl(RuntimeError):
    """The installed NeMo-RL's vLLM refit is not the code this hook was written against."""


def refit_hook_env(parity: bool) -> dict[str, str]:
    """vLLM worker env that makes `load_in_worker` install the hook (``jetrl.refit_parity_check``
    decides ``parity``)."""
    return {ENV_VAR: json.dumps({"parity": bool(parity)})}


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
class SentTensors:
    """What one refit sent through the hook (kept only while parity is on)."""

    fp8: dict[str, torch.Tensor] = field(default_factory=dict)
    fp8_layers: list[str] = field(default_factory=list)
    other: dict[str, torch.Tensor] = field(default_factory=dict)
    kv: dict[str, dict[str, float]] = field(default_factory=dict)
    error: Exception | None = None
    keep: bool = True
    """False when parity is off: nothing is kept, errors are still recorded."""


@dataclass
class HookState:
    settings: PatchSettings
    parity: bool
    layout: str
    handle: NrlRefitHandle | None = None


def _engine_dtype(model: torch.nn.Module, name: str) -> torch.dtype | None:
    try:
        return resolve_hf_name(model, name)[1].dtype
    except (KeyError, AttributeError):
        return None


def quantize_batch(
    weights: list[tuple[str, torch.Tensor]],
    model: torch.nn.Module,
    settings: PatchSettings,
    sent: SentTensors | None,
) -> list[tuple[str, torch.Tensor]]:
    """One streamed batch -> what the model's ``load_weights`` gets (our FP8 + scales)."""
    fp8_names = {k for k, _ in weights if is_fp8_weight(k, settings)}
    wrong = [
        f"{k}: MoE experts (nemo_jetrl has no MoE support)" for k, _ in weights if ".experts." in k
    ]
    for k, _ in weights:
        if not k.endswith(".weight"):
            continue
        dtype = _engine_dtype(model, k)
        engine_fp8 = dtype is not None and dtype.itemsize == 1 and dtype.is_floating_point
        if (k in fp8_names) != engine_fp8 and (dtype is not None or k in fp8_names):
            wrong.append(
                f"{k}: the recipe runs it in {'FP8' if k in fp8_names else 'BF16'}, the engine "
                f"holds {dtype}"
            )
    if wrong:
        raise RefitError(
            "refit refused: the vLLM engine's FP8 layers differ from the recipe's (align "
            "policy.generation.vllm_cfg num_*_layers_in_bf16 / quantization_ignored_layer_kws "
            "with jetrl's BF16 layers):\n  - " + "\n  - ".join(wrong)
        )
    qsd = quantize_state_dict({k: v for k, v in weights if k in fp8_names}, settings)
    out: list[tuple[str, torch.Tensor]] = []
    for k, v in weights:
        if k in fp8_names:
            scale = f"{k[: -len('.weight')]}.{SCALE_SUFFIX}"
            out += [(k, qsd.tensors[k]), (scale, qsd.tensors[scale])]
        elif (m := KV_NAME.match(k)) is not None:
            # NeMo-RL names q "<layer>.self_attn.attn.q_scale"; vLLM's loader (0.20's
            # maybe_remap_kv_scale_name) maps that to "...attn.attn.q_scale" and drops it. The
            # k/v form loads: "<layer>.self_attn.q_scale" -> "<layer>.self_attn.attn.q_scale".
            out.append((f"{m['layer']}.{m['t']}_scale", v))
        else:
            out.append((k, v))
    if sent is not None and sent.keep:
        sent.fp8.update({k: t.detach().cpu().clone() for k, t in qsd.tensors.items()})
        sent.fp8_layers += qsd.fp8_layers
        for k, v in weights:
            if k in fp8_names:
                continue
            m = KV_NAME.match(k)
            if m is not None:
                sent.kv.setdefault(f"{m['layer']}.attn", {})[m["t"]] = float(v.reshape(-1)[0])
            elif _engine_dtype(model, k) is not None:
                sent.other[k] = v.detach().cpu().clone()
    return out


class _ReadBack(JetRLWorkerExtension):
    """Our worker extension's read-back methods over NeMo-RL's worker (same model and config)."""

    def __init__(self, worker: Any) -> None:
        self.model_runner = worker.model_runner
        self.vllm_config = worker.vllm_config


class _InProcessRpc:
    """``check_parity`` asks an ``llm.collective_rpc``; inside the worker we call directly."""

    def __init__(self, worker: Any) -> None:
        self._ext = _ReadBack(worker)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return [getattr(self._ext, method)(*args)]


def _kv_differences(model: torch.nn.Module, kv: dict[str, dict[str, float]], fp8_kv: bool) -> list:
    """Sent KV scales vs the attention layers' loaded parameters (and, with an FP8 KV cache, the
    values its kernels use)."""
    out = []
    for layer, per in sorted(kv.items()):
        module = model.get_submodule(layer)
        used = compat.read_attention_kv_scales(module) if fp8_kv else {}
        for t, want in sorted(per.items()):
            w32 = float(torch.tensor(want, dtype=torch.float32))
            param = getattr(module, f"{t}_scale", None)
            got = float(param.reshape(-1)[0]) if isinstance(param, torch.Tensor) else None
            if got != w32:
                out.append(
                    f"{layer}.{t}_scale (sent {want!r}, the layer's parameter holds {got!r})"
                )
            elif fp8_kv and used.get(t) != w32:
                out.append(f"{layer}.{t}_scale (sent {want!r}, attention uses {used.get(t)!r})")
    return out


def check_refit_parity(worker: Any, sent: SentTensors) -> ParityReport:
    """Everything one refit sent vs what the engine now holds; ParityError names differences."""
    qsd = QuantizedStateDict({**sent.fp8, **sent.other}, tuple(sent.fp8_layers), tuple(sent.other))
    report = check_parity(_InProcessRpc(worker), qsd)
    fp8_kv = "fp8" in str(worker.vllm_config.cache_config.cache_dtype)
    kv = _kv_differences(worker.model_runner.model, sent.kv, fp8_kv)
    if kv:
        raise ParityError("refit parity check failed: KV scales differ:\n  - " + "\n  - ".join(kv))
    return ParityReport(
        compared=report.compared + sum(len(p) for p in sent.kv.values()),
        fp8=report.fp8,
        through_kernel=report.through_kernel,
        differing=(),
    )


def _make_load_weights(state: HookState) -> Any:
    def load_weights(weights: Any, model_runner: Any) -> None:
        sent = getattr(model_runner, "_jetrl_sent", None)
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
            batch = quantize_batch(list(weights), model_runner.model, state.settings, sent)
        except RefitError as exc:
            if sent is not None:
                sent.error = exc  # NeMo-RL's transport swallows it; the wrapper re-raises
            raise
        model_runner.model.load_weights(batch)

    setattr(load_weights, MARK, state)
    return load_weights


def _make_transport(original: Any, state: HookState) -> Any:
    @functools.wraps(original)
    def transport(self: Any, *args: Any, **kwargs: Any) -> Any:
        runner = self.model_runner
        sent = runner._jetrl_sent = SentTensors(keep=state.parity)
        try:
            ok = original(self, *args, **kwargs)
        finally:
            runner._jetrl_sent = None
        if sent.error is not None:
            raise sent.error
        if ok and state.parity:
            tp = int(self.vllm_config.parallel_config.tensor_parallel_size)
            if tp != 1:  # the read-back (jetrl_read_back) slices unsharded parameters
                raise RefitError(
                    f"jetrl.refit_parity_check supports vLLM tensor_parallel_size=1, this engine "
                    f"has {tp}: set it to false (weights are still quantized by nemo_jetrl.fp8)"
                )
            runner._jetrl_last_parity = check_refit_parity(self, sent)
        return ok

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


def install_refit_hook(settings: PatchSettings, *, parity: bool = True) -> NrlRefitHandle:
    """Hook NeMo-RL's vLLM refit in this process (see the module docstring); idempotent."""
    fp8_mod = require(FP8_MODULE, feature="the NeMo-RL refit hook")
    backend = require(BACKEND_MODULE, feature="the NeMo-RL refit hook")
    ext = backend.VllmInternalWorkerExtension
    current = getattr(fp8_mod.load_weights, MARK, None)
    if current is not None:
        if current.settings == settings and current.parity == parity and current.handle:
            return current.handle
        raise RuntimeError(
            "the nemo_jetrl NeMo-RL refit hook is already installed with other settings; "
            "revert that handle first"
        )
    state = HookState(settings, parity, detect_layout(ext, fp8_mod))
    patches = [(fp8_mod, "load_weights", fp8_mod.load_weights, _make_load_weights(state))]
    for name in TRANSPORTS:
        patches.append((ext, name, ext.__dict__[name], _make_transport(ext.__dict__[name], state)))
    owners = [ext, getattr(backend, "VllmCheckpointEngineMixin", None)]
    for owner in filter(None, owners):
        for name in BYPASSING:
            if name in owner.__dict__:
                patches.append((owner, name, owner.__dict__[name], _make_refusal(name)))
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
        parity = json.loads(text)["parity"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f'{ENV_VAR}={text!r}: expected {{"parity": true|false}} ({exc})') from None
    patch = os.environ.get(PATCH_ENV)
    if not patch:
        raise RuntimeError(
            f"{ENV_VAR} is set but {PATCH_ENV} is not: the refit hook quantizes with the vLLM "
            "patch's settings; start vLLM through nemo_jetrl's NeMo-RL launcher"
        )
    _PLUGIN_HANDLE = install_refit_hook(PatchSettings.from_json(patch), parity=bool(parity))
