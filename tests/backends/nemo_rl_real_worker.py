"""NeMo-RL's REAL Megatron policy worker module (``MegatronPolicyWorkerImpl``) on CPU: the
import-time stand-ins and the GPU stand-ins test_nemo_rl_worker_glue.py runs it with (each one
labelled where it is defined; that module's docstring says which of them the path executes).

- `_real_worker_module`: imports ``MPW`` with the version gaps (`GAPS`: megatron-core /
  megatron-bridge symbols the tree names at import that the installed wheels lack; each raises if
  called) and Transformer Engine for `_TE_IMPORTERS` only, then takes every stand-in back out.
- `_base_init`: the base class's GPU ``__init__``; `_CudaOnCpu`: ``"cuda"`` tensors stay on the
  CPU; `_ltor_masks`: Megatron-LM's ``get_ltor_masks_and_position_ids`` (in no megatron-core wheel).
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

MPW = "nemo_rl.models.policy.workers.megatron_policy_worker"


@dataclass(frozen=True)
class Gap:
    """A symbol the tree imports that the installed megatron-core / megatron-bridge lacks."""

    module: str
    symbol: str
    trees: tuple[str, ...]  # "v0.7.0", "main"
    why: str


_CORE = "not in megatron-core 0.16.1 (NeMo-RL pins a newer Megatron-LM by git submodule)"
_BRIDGE = "not in megatron-bridge 0.3.1 (main pins a newer Megatron-Bridge by git submodule)"
_BOTH = ("v0.7.0", "main")
GAPS = (
    # megatron_policy_worker -> nemo_rl.models.generation.megatron.megatron_worker (the Megatron
    # inference engine, a generation backend this path never builds)
    Gap("megatron.core.inference.config", "InferenceConfig", _BOTH, _CORE + "; module too"),
    Gap("megatron.core.inference.config", "KVCacheManagementMode", _BOTH, _CORE),
    Gap("megatron.core.inference.config", "PrefixCachingCoordinatorPolicy", _BOTH, _CORE),
    Gap("megatron.core.inference.engines.dynamic_engine", "EngineState", _BOTH, _CORE),
    Gap("megatron.core.transformer.enums", "InferenceCudaGraphScope", _BOTH, _CORE),
    Gap("megatron.core.inference.utils", "device_memory_summary", _BOTH, _CORE),
    Gap("megatron.core.resharding.refit", "prepare_swap_model_weights", ("main",), _CORE),
    # megatron_policy_worker itself (async checkpoint saving, Megatron-FSDP wrappers)
    Gap(
        "megatron.core.dist_checkpointing.strategies.torch", "get_async_strategy", ("main",), _CORE
    ),
    Gap(
        "megatron.core.distributed.fsdp.mcore_fsdp_adapter",
        "FullyShardedDataParallelV1",
        ("main",),
        _CORE,
    ),
    Gap(
        "megatron.core.distributed.fsdp.mcore_fsdp_adapter",
        "FullyShardedDataParallelV2",
        ("main",),
        _CORE,
    ),
    # nemo_rl.models.megatron.common (MoE metrics) / setup (inference shards, CUDA graphs) / data
    # (packing under context parallelism)
    Gap(
        "megatron.core.transformer.moe.moe_logging",
        "get_moe_metrics_tracker",
        ("main",),
        _CORE + "; module too",
    ),
    Gap(
        "megatron.core.inference.shards",
        "build_inference_pg_collection",
        ("main",),
        _CORE + "; module too",
    ),
    Gap(
        "megatron.bridge.training.utils.packed_seq_utils",
        "get_packed_seq_cp_partition_indices",
        ("main",),
        _BRIDGE,
    ),
    Gap(
        "megatron.bridge.utils.cuda_graph",
        "set_cuda_graph_modules",
        ("main",),
        _BRIDGE + "; module too",
    ),
)

# megatron-bridge 0.3.1 modules with an unconditional ``import transformer_engine.pytorch as te``
# (PEFT/LoRA layers; the rest of megatron-bridge and all of megatron-core try/except TE and
# keep seeing no TE, as on any machine without CUDA).
_TE_IMPORTERS = frozenset({"megatron.bridge.peft.lora_layers", "megatron.bridge.peft.lora"})


def _tree() -> str:
    tree = os.environ.get("JETRL_NEMO_RL_TREE", "")
    return "main" if tree.startswith("main") else tree


def _placeholder(gap: Gap) -> type:
    def refuse(*_a: Any, **_k: Any) -> None:
        raise RuntimeError(f"STAND-IN {gap.module}.{gap.symbol} ({gap.why}) was called")

    return type(gap.symbol, (), {"__init__": refuse, "__doc__": f"STAND-IN: {gap.why}"})


def _te_standin() -> types.ModuleType:
    """STAND-IN for ``transformer_engine`` (GPU only), given only to `_TE_IMPORTERS`: the names
    their class bodies and signatures use at import (``te.Linear`` is a base class,
    ``te.ops.Sequential`` an annotation); nothing of it runs without PEFT."""
    te = types.ModuleType("transformer_engine (stand-in)")
    pt = types.ModuleType("transformer_engine.pytorch (stand-in)")
    pt.Linear = type("Linear", (torch.nn.Module,), {})
    pt.LayerNormLinear = type("LayerNormLinear", (torch.nn.Module,), {})
    pt.ops = types.SimpleNamespace(Sequential=type("Sequential", (torch.nn.Module,), {}))
    te.pytorch = pt
    return te


@contextlib.contextmanager
def _real_worker_module() -> Iterator[tuple[types.ModuleType, list[Gap]]]:
    """Import NeMo-RL's real worker module with the import-time stand-ins, then take every
    stand-in back out of megatron-core / megatron-bridge / sys.modules at once; on exit, forget
    the NeMo-RL and megatron-bridge modules that import loaded (they may hold stand-ins), so no
    later test sees them. Fails, never skips, if the module still does not import."""
    tree = _tree()
    assert tree in ("v0.7.0", "main"), f"JETRL_NEMO_RL_TREE={tree!r}: run via test_nemo_rl.sh"
    te = _te_standin()
    real_import = builtins.__import__

    def scoped_import(name: str, globals: Any = None, *args: Any, **kwargs: Any) -> Any:
        who = (globals or {}).get("__name__", "")
        if name.split(".")[0] == "transformer_engine" and who in _TE_IMPORTERS:
            return te
        return real_import(name, globals, *args, **kwargs)

    before = set(sys.modules)
    added_modules: list[str] = []
    added_attrs: list[tuple[types.ModuleType, str]] = []
    used: list[Gap] = []
    for gap in GAPS:
        if tree not in gap.trees:
            continue
        try:
            mod = importlib.import_module(gap.module)
        except ModuleNotFoundError:
            mod = types.ModuleType(gap.module, f"STAND-IN: {gap.why}")
            sys.modules[gap.module] = mod
            added_modules.append(gap.module)
        if hasattr(mod, gap.symbol):
            continue  # a newer megatron-core/-bridge has it: real_mpw reports the list stale
        setattr(mod, gap.symbol, _placeholder(gap))
        added_attrs.append((mod, gap.symbol))
        used.append(gap)
    builtins.__import__ = scoped_import
    try:
        mod = importlib.import_module(MPW)
    finally:
        builtins.__import__ = real_import
        for m, sym in added_attrs:
            if m.__name__ not in added_modules:
                delattr(m, sym)
        for name in added_modules:
            sys.modules.pop(name, None)
    try:
        yield mod, used
    finally:
        for name in set(sys.modules) - before:
            if name.startswith(("nemo_rl.", "megatron.bridge")):
                del sys.modules[name]


class _CudaOnCpu(TorchFunctionMode):
    """STAND-IN for the GPU: tensors NeMo-RL puts on ``"cuda"`` (``.to("cuda")``, ``.cuda()``,
    ``device="cuda"``) stay on / are made on the CPU. Nothing else is changed."""

    @staticmethod
    def _cuda(d: Any) -> bool:
        return (isinstance(d, str) and d.startswith("cuda")) or (
            isinstance(d, torch.device) and d.type == "cuda"
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if self._cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if self._cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _ltor_masks(data: torch.Tensor, **_flags: Any) -> tuple[torch.Tensor, None, torch.Tensor]:
    """STAND-IN for Megatron-LM's ``megatron.training.utils.get_ltor_masks_and_position_ids``
    (in no megatron-core wheel), for the flags NeMo-RL passes (no resets, loss mask unused):
    the causal mask [1, 1, s, s] (True = masked) and positions 0..s-1 per row."""
    from megatron_shims import causal_mask

    b, s = data.shape
    return causal_mask(s).to(data.device), None, torch.arange(s).expand(b, s).to(data.device)


def _base_init(self: Any, config: dict, *, model: torch.nn.Module, bridge: Any) -> None:
    """STAND-IN for ``MegatronPolicyWorkerImpl.__init__`` (NCCL/Megatron setup, checkpoint load,
    CUDA placement): the attributes ``get_logprobs`` and ``_iter_params_with_optional_kv_scales``
    read, set as the real ``__init__`` sets them (NeMo-RL's own helpers where it has them)."""
    from megatron.bridge.training.state import GlobalState

    mpw = sys.modules[MPW]
    self.cfg = config
    self.model = model
    self.mcore_state = GlobalState()  # megatron-bridge's; get_logprobs reads its straggler timer
    self.megatron_bridge = bridge
    self.refit_conversion_tasks = None
    self.draft_model = None
    self.sampling_params = None
    self._router_replay_enabled = mpw.router_replay_enabled(config)
    self.defer_fp32_logits = config["megatron_cfg"].get("defer_fp32_logits", None)
    self.delegate_pack_to_model = mpw._model_self_packs_for_cp(model)
    if _tree() == "main":
        from nemo_rl.utils.timer import Timer

        self.timer = Timer()
        self.media_placeholder_token_id = None  # text-only model
        self.delegate_mtp_loss_mask_to_model = mpw._model_self_packs_mtp_loss_mask(model)
        self.model_slices_context_parallel_inputs = mpw._model_slices_context_parallel_inputs(model)
