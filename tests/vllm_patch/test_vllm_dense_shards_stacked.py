"""A rank's part of an HF tensor that vLLM splits into several fused outputs (Qwen3.5's gated
DeltaNet at ``tensor_parallel_size`` 2): ``dense_shards.rank_expected`` must cut what the trainer
sent exactly as vLLM's own loaders write it, or the refit parity compares the wrong rows.

vLLM loads ``in_proj_qkv`` [q; k; v] into outputs 0-2 of ``in_proj_qkvz`` (a tuple shard id,
``Qwen3_5Model.hf_to_vllm_mapper``) and cuts each output per rank, so rank 1 holds rows
``[kd/2, kd) + [kd + kd/2, 2kd) + [2kd + vd/2, 2kd + vd)`` of the HF tensor, not one range; its
block-FP8 ``weight_scale_inv`` the same rows in 128-blocks. The ``conv1d`` channels [q; k; v]
go through ``mamba_v2_sharded_weight_loader``, cut the same way.

No engine: the layers are vLLM's own (``MergedColumnParallelLinear`` with our block-FP8 kernel,
``ColumnParallelLinear`` with vLLM's mamba loader, as its ``GatedDeltaNet`` sets it), built on
tensor-parallel rank r of 2 with vLLM's TP size/rank lookups answered 2 / r (STAND-IN: no process
group), and loaded with their own weight loaders from full HF tensors. The model around them is a
labelled STAND-IN holding the real ``Qwen3_5`` classes' ``packed_modules_mapping`` and
``hf_to_vllm_mapper``. The engine side is read with ``worker_ext.resolve_hf_name``, as parity does.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.vllm_in_nemo_rl,
    pytest.mark.vllm_versions(
        "0.32",
        "0.25",
        why="vLLM 0.20 has no orig_to_new_stacked for Qwen3.5 (engine_names does not map its "
        "in_proj_qkv at any TP); 0.25.1 runs it in the NeMo-RL main tier",
    ),
]

H, KD, VD, CONV_K, TP = 256, 256, 512, 4, 2
LAYER = "model.layers.0.linear_attn"
# vLLM's Qwen3_5Model.hf_to_vllm_mapper stacking and Qwen3_5ForCausalLMBase's packed modules
# (importing vllm.model_executor.models.qwen3_5 needs torchvision; the source is checked below)
STACKED = {".in_proj_qkv": (".in_proj_qkvz", (0, 1, 2)), ".in_proj_z": (".in_proj_qkvz", 3)}
PACKED = {"in_proj_qkvz": ["in_proj_qkv", "in_proj_z"], "in_proj_ba": ["in_proj_b", "in_proj_a"]}


def test_the_standin_mappings_are_vllms():
    import importlib.util
    from pathlib import Path

    source = Path(importlib.util.find_spec("vllm.model_executor.models.qwen3_5").origin)
    text = source.read_text()
    for old, (new, idx) in STACKED.items():
        assert f'"{old}": ("{new}", {idx})' in text, old
    for fused, shards in PACKED.items():
        assert f'"{fused}": {shards}'.replace("'", '"') in text, fused


def _fake_tp(mp: pytest.MonkeyPatch, rank: int, tp: int = TP) -> None:
    import vllm.distributed as dist
    import vllm.distributed.parallel_state as ps
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.parameter as parameter

    for mod in (linear, parameter, dist, ps):
        mp.setattr(mod, "get_tensor_model_parallel_world_size", lambda: tp, raising=False)
        mp.setattr(mod, "get_tensor_model_parallel_rank", lambda: rank, raising=False)


@pytest.fixture(scope="module")
def settings():
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import settings_from_recipe
    from nemo_jetrl.vllm_patch.kernel import register_kernel, unregister_kernel

    s = settings_from_recipe(Recipe.preset("jetrl"))
    register_kernel(s)  # vLLM's CPU block-FP8 kernels need AMX; ours runs anywhere
    yield s
    unregister_kernel()


def _model(rank: int) -> nn.Module:
    """The STAND-IN model: one gated-DeltaNet's in_proj_qkvz (block FP8) and conv1d (BF16),
    vLLM's layers on rank ``rank`` of 2."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear
    from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.models.utils import WeightsMapper

    cfg = VllmConfig()
    object.__setattr__(cfg, "model_config", SimpleNamespace(dtype=torch.bfloat16))
    quant = Fp8Config(True, "dynamic", None, [128, 128])
    with set_current_vllm_config(cfg):
        qkvz = MergedColumnParallelLinear(
            H, [KD, KD, VD, VD], bias=False, quant_config=quant, prefix=f"{LAYER}.in_proj_qkvz"
        )
    conv = ColumnParallelLinear(
        CONV_K, 2 * KD + VD, bias=False, params_dtype=torch.bfloat16, prefix=f"{LAYER}.conv1d"
    )
    conv.weight.data = conv.weight.data.unsqueeze(1)
    spec = [(KD, 0, False), (KD, 0, False), (VD, 0, False)]
    conv.weight.weight_loader = mamba_v2_sharded_weight_loader(spec, TP, rank)

    class Root(nn.Module):
        hf_to_vllm_mapper = WeightsMapper(orig_to_new_stacked=dict(STACKED))
        packed_modules_mapping: ClassVar[dict] = dict(PACKED)

    attn = nn.Module()
    attn.in_proj_qkvz, attn.conv1d = qkvz, conv
    layer = nn.Module()
    layer.linear_attn = attn
    root = Root()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([layer])
    return root


def _hf_tensors(settings) -> dict[str, torch.Tensor]:
    from nemo_jetrl.vllm_patch.refit import quantize_state_dict

    g = torch.Generator().manual_seed(0)
    bf16 = {
        f"{LAYER}.in_proj_qkv.weight": torch.randn(2 * KD + VD, H, generator=g),
        f"{LAYER}.in_proj_z.weight": torch.randn(VD, H, generator=g),
        f"{LAYER}.conv1d.weight": torch.randn(2 * KD + VD, 1, CONV_K, generator=g),
    }
    # rows of different magnitudes so that every 128-block has its own scale
    bf16[f"{LAYER}.in_proj_qkv.weight"] *= torch.arange(1, 2 * KD + VD + 1)[:, None] / 64
    return quantize_state_dict(bf16, settings, dtype=torch.bfloat16).tensors


def _load(model: nn.Module, name: str, t: torch.Tensor) -> None:
    """What vLLM's model loader does for ``name`` (Qwen3_5Model's stacked mapping)."""
    attn = model.model.layers[0].linear_attn
    leaf = name.rpartition(".")[2]
    if ".conv1d." in name:
        attn.conv1d.weight.weight_loader(attn.conv1d.weight, t)
        return
    shard = (0, 1, 2) if ".in_proj_qkv." in name else 3
    param = getattr(attn.in_proj_qkvz, leaf)
    param.weight_loader(param, t, shard)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_expects_the_rows_vllm_loaded(settings, rank):
    from nemo_jetrl.vllm_patch.dense_shards import rank_expected
    from nemo_jetrl.vllm_patch.worker_ext import resolve_hf_name

    sent = _hf_tensors(settings)
    with pytest.MonkeyPatch.context() as mp:
        _fake_tp(mp, rank)
        model = _model(rank)
    assert model.model.layers[0].linear_attn.in_proj_qkvz.tp_rank == rank
    for name, t in sent.items():
        _load(model, name, t)
    checked = []
    for name, t in sent.items():
        _, param, start, rows = resolve_hf_name(model, name)
        engine = param.data[start : start + rows]
        want = rank_expected(model, name, t)
        assert tuple(want.shape) == tuple(engine.shape), (name, want.shape, engine.shape)
        a, b = (x.contiguous().view(torch.uint8) for x in (want, engine))
        assert torch.equal(a, b), f"{name}: rank {rank} expects other rows than vLLM loaded"
        checked.append(name)
    assert len(checked) == 5  # qkv and z: weight + scale; conv1d
    # rank 1's q rows of in_proj_qkv are the second half of q, not the first 128 rows of k
    qkv = sent[f"{LAYER}.in_proj_qkv.weight"]
    got = rank_expected(model, f"{LAYER}.in_proj_qkv.weight", qkv)
    half = KD // TP
    assert torch.equal(
        got[:half].view(torch.uint8), qkv[rank * half : (rank + 1) * half].view(torch.uint8)
    )
