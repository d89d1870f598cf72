"""Our NeMo-RL Megatron worker's calibration glue (``backends/nemo_rl/worker.py``) on CPU, through
NeMo-RL's REAL ``MegatronPolicyWorkerImpl`` (the tree under test, v0.7.0 or main 7ea279a).

What runs for real: our worker class as ``make_worker_class`` builds it, subclassing NeMo-RL's
real ``MegatronPolicyWorkerImpl`` (Ray's real ``ray.remote`` wrapping; the test instantiates the
class Ray wraps); our ``__init__`` glue (KV hooks, BF16 linears); our
``calibrate_qkv_fp8_scales``, which drives NeMo-RL's real ``get_logprobs`` (its micro-batch
iterator, ``process_microbatch``, ``megatron_forward_backward`` -> megatron-core's
``forward_backward_no_pipelining``, ``LogprobsPostProcessor``) over a real megatron-core GPTModel
on CPU; our ``_iter_params_with_optional_kv_scales`` override, which streams NeMo-RL's real
iterator: megatron-bridge 0.3.1's real ``AutoBridge.export_hf_weights`` (from a tiny HF Qwen3
checkpoint written to tmp) then the FP8 KV scale tensors under vLLM's names.

STAND-INS (each labelled where it is defined below):
- GPU: the base class's ``__init__`` (Megatron/NCCL setup, checkpoint load, moving to CUDA):
  `_base_init` sets the attributes the methods above read, with NeMo-RL's own helpers where it
  has them; CUDA devices (``data.to("cuda")`` in NeMo-RL's micro-batch iterator, the scale
  tensors' ``device="cuda"``) land on the CPU (`_CudaOnCpu`), plus tests/megatron_shims.py's two
  shims; Transformer Engine for the two megatron-bridge modules that import it unconditionally
  (`_TE_IMPORTERS`: TE's torch extension loads CUDA libraries).
- Version gaps, at import only: megatron-core symbols the worker module (or a module it imports)
  names at import time that megatron-core 0.16.1 (the newest for Python 3.11) lacks, and on main
  two megatron-bridge symbols newer than 0.3.1 (the newest for megatron-core < 0.17): `GAPS`.
  None is executed by get_logprobs or the refit iterator; each raises if called.
- ``megatron.training.utils.get_ltor_masks_and_position_ids`` (`_ltor_masks`): Megatron-LM's
  training package ships in no megatron-core wheel; NeMo-RL imports it at call time in
  ``process_microbatch``. The one stand-in the path executes: the causal mask and positions.

Asserted: the calibrated scales equal a direct calibration on the real tokens (the lengths passed
on mask the padding; counting the padding would move them >1.5x), and the real refit iterator,
called with no scales, ships the bridge's exported weights followed by exactly those scales
(contradicting caller scales refused). Each of these worker.py slips fails the test on both trees
(scripts/mutants.py, "worker ..."): no lengths passed, lengths of other rows, ``by_lengths``
off (``got == want``); the iterator override not installed, the calibration not kept for the
refit (the shipped-scales assertion). If the real class does not import, the test errors; it
never skips.
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
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nemo_jetrl.backends.nemo_rl import translate as nt
from nemo_jetrl.kvcache import CalibrationSettings
from nemo_jetrl.megatron.attention import calibrate_megatron
from nemo_jetrl.recipe import Recipe

pytestmark = pytest.mark.nemo_rl

MPW = "nemo_rl.models.policy.workers.megatron_policy_worker"
LENGTHS = [5, 12, 3, 9]
WIDTH = 16
PAD = 7  # the padding token (its V in layer 0 made an outlier, see model())


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


def _cfg() -> dict[str, Any]:
    """The policy-config keys the real methods read (NeMo-RL's PolicyConfig names)."""
    return {
        "logprob_batch_size": 2,
        "sequence_packing": {"enabled": False},
        "dynamic_batching": {"enabled": False},
        "megatron_cfg": {"defer_fp32_logits": None},
        "generation": {"backend": "vllm", "vllm_cfg": {"kv_cache_dtype": "fp8"}},
    }


@pytest.fixture(scope="module")
def real_mpw() -> Iterator[types.ModuleType]:
    with _real_worker_module() as (mod, used):
        tree = _tree()
        stale = [g for g in GAPS if tree in g.trees and g not in used]
        assert not stale, f"megatron-core/-bridge now has these: drop their stand-ins: {stale}"
        yield mod


@pytest.fixture
def worker_cls(monkeypatch, real_mpw):
    from nemo_jetrl.backends.nemo_rl import worker

    recipe = Recipe.preset("jetrl_kv")
    monkeypatch.setenv(nt.RECIPE_ENV, nt.recipe_to_json(recipe))
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0")
    monkeypatch.setattr(real_mpw.MegatronPolicyWorkerImpl, "__init__", _base_init)
    training = types.ModuleType("megatron.training")
    utils = types.ModuleType("megatron.training.utils")
    utils.get_ltor_masks_and_position_ids = _ltor_masks
    training.utils = utils
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.utils", utils)
    worker.make_worker_class.cache_clear()
    cls = worker.make_worker_class().__ray_actor_class__
    assert real_mpw.MegatronPolicyWorkerImpl in cls.__mro__  # NeMo-RL's real class, not a copy
    yield cls, recipe
    worker.make_worker_class.cache_clear()


@pytest.fixture
def model():
    from megatron_shims import build_gpt, megatron_cpu

    with megatron_cpu():
        m = build_gpt()
        with torch.no_grad():
            # Channel 3 carries only the padding token, and layer 0's QKV weights amplify it:
            # padded V are outliers, real tokens' are unchanged.
            emb = m.embedding.word_embeddings.weight
            emb[:, 3] = 0.0
            emb[PAD] = 0.0
            emb[PAD, 3] = 1.0
            m.decoder.layers[0].self_attention.linear_qkv.weight[:, 3] *= 100.0
        yield m.eval()


def _bridge(tmp: Path) -> Any:
    """megatron-bridge's real AutoBridge for the test GPT's architecture, from a tiny HF Qwen3
    checkpoint (random weights; the bridge reads its config and weight order)."""
    from megatron.bridge import AutoBridge
    from megatron_shims import TinyGpt
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = TinyGpt()
    hf = Qwen3Config(
        vocab_size=d.vocab_size,
        hidden_size=d.hidden_size,
        intermediate_size=d.ffn_hidden_size,
        num_hidden_layers=d.num_layers,
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_query_groups,
        head_dim=d.kv_channels,
        max_position_embeddings=d.max_seq,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    )
    Qwen3ForCausalLM(hf).save_pretrained(tmp)
    return AutoBridge.from_hf_pretrained(str(tmp))


def _data():
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(0)
    ids = torch.full((len(LENGTHS), WIDTH), PAD, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = torch.randint(10, 500, (n,), generator=g)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    return BatchedDataDict({"input_ids": ids, "input_lengths": lengths}), ids, lengths


def _reference(model, recipe, ids, lengths, by_lengths: bool) -> dict:
    from megatron_shims import forward

    settings = CalibrationSettings.from_recipe(recipe.kv_calibration, include_q=False)
    batches = [
        (
            lambda i=i: forward(model, ids[i : i + 2]),
            lengths[i : i + 2].long() if by_lengths else None,
        )
        for i in range(0, len(LENGTHS), 2)
    ]
    return calibrate_megatron(model, batches, settings=settings).to_nemo_rl(settings)["layers"]


def test_calibration_masks_padding_by_lengths_and_refit_ships_it(worker_cls, model, tmp_path):
    cls, recipe = worker_cls
    data, ids, lengths = _data()
    bridge = _bridge(tmp_path)
    with _CudaOnCpu():
        w = cls(_cfg(), model=model, bridge=bridge)  # our hooks: on-policy KV at scale 1.0
        # References through the same hooks, before the worker's calibration changes the scales.
        want = _reference(model, recipe, ids, lengths, by_lengths=True)
        every_token = _reference(model, recipe, ids, lengths, by_lengths=False)
        out = w.calibrate_qkv_fp8_scales(data=data)
        got = out["layers"]
        assert out["jetrl"]["micro_batches"] == 2 and out["jetrl"]["refused"] == {}
        # Padding masked by input_lengths: the scales of a direct calibration on the real tokens.
        assert got == want
        # The padding outliers would move them (so the check above can fail).
        moved = [k for k in got if every_token[k] > 1.5 * got[k]]
        assert moved, (every_token, got)
        # Refit: a caller passing no scales (v0.7.0's colocated refit) ships our calibration,
        # after the weights megatron-bridge exports (NeMo-RL's real iterator: weights, then
        # q/k/v scales under vLLM's names, 1.0 where none is given).
        refit = dict(w._iter_params_with_optional_kv_scales())
        exported = dict(bridge.export_hf_weights([model], show_progress=False))
        assert "model.layers.1.self_attn.k_proj.weight" in exported
        for name, t in exported.items():
            assert torch.equal(refit.pop(name), t), name
        shipped = {n: float(t) for n, t in refit.items()}
        assert len(shipped) == 3 * len(model.decoder.layers), shipped
        assert {n: shipped.get(n) for n in got} == got, shipped  # every k/v scale, exactly
        assert all(v == 1.0 for n, v in shipped.items() if n not in got)  # q: not calibrated
        # Scales a caller passes that contradict the trainer's calibration are refused.
        caller = {k: 2 * v for k, v in got.items()}
        with pytest.raises(ValueError, match="differ from the trainer's calibration"):
            list(w._iter_params_with_optional_kv_scales(kv_scales=caller))
