"""`flow.vllm_layout`'s words checked against vLLM's own block-FP8 layers at tensor-parallel size
8 (rank 1 of 8; vLLM's TP size/rank lookups answered, as in test_vllm_dense_shards_stacked.py,
whose fixtures this module uses: STAND-IN for a process group, the layers and loaders are vLLM's).

- Qwen3-4B's down_proj (9728 / 8 = 1216 input columns a rank): vLLM refuses the layer;
- its gate/up (1216 rows a rank) and Llama-3.2-1B's k_proj (8 KV heads of 64 on 8 ranks: 64
  rows a rank): vLLM accepts the fused layer; its scale loader then cuts ceil-sized blocks, so
  rank 1's k gets HF scale row 1 (HF rows 128-255) for its HF rows 64-127, silently, and v does
  not fit at all; `dense_shards` refuses the tensor by name (the refit with parity on).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_vllm_dense_shards_stacked import _fake_tp, settings  # noqa: F401 (fixture)

from nemo_jetrl.arch import ModelArch
from nemo_jetrl.flow.vllm_layout import split_problem

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_in_nemo_rl]

TP, RANK = 8, 1
LLAMA_1B = dict(
    model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=1,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=256,
)  # fmt: skip
QWEN3_4B = dict(
    LLAMA_1B, model_type="qwen3", hidden_size=2560, intermediate_size=9728, head_dim=128
)


def _words(cfg: dict, kind: str) -> str:
    arch = ModelArch.from_hf_config(cfg, name="m")
    lin = next(x for x in arch.distinct_linears() if x.kind == kind)
    why = split_problem(arch, lin, TP)
    assert why is not None, kind
    return why


def _build(make: Callable[[Any], Any]) -> Any:
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    cfg = VllmConfig()
    object.__setattr__(cfg, "model_config", SimpleNamespace(dtype=torch.bfloat16))
    with pytest.MonkeyPatch.context() as mp, set_current_vllm_config(cfg):
        _fake_tp(mp, RANK, TP)
        return make(Fp8Config(True, "dynamic", None, [128, 128]))


def test_row_parallel_split_off_a_block_is_refused_by_vllm(settings):  # noqa: F811
    from vllm.model_executor.layers.linear import RowParallelLinear

    assert "vLLM refuses the engine" in _words(QWEN3_4B, "down_proj")
    with pytest.raises(ValueError, match="input_size_per_partition = 1216 is not divisible"):
        _build(lambda q: RowParallelLinear(9728, 2560, bias=False, quant_config=q, prefix="d"))


def test_fused_column_split_off_a_block_is_accepted_by_vllm(settings):  # noqa: F811
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    assert "vLLM accepts the fused layer" in _words(QWEN3_4B, "gate_proj")
    layer = _build(
        lambda q: MergedColumnParallelLinear(
            2560, [9728, 9728], bias=False, quant_config=q, prefix="g"
        )
    )
    assert layer.allow_fp8_block_shape_mismatch and layer.output_partition_sizes == [1216, 1216]


def test_k_of_64_rows_a_rank_loads_another_blocks_scale_and_our_refit_refuses(settings):  # noqa: F811
    from torch import nn
    from vllm.model_executor.layers.linear import QKVParallelLinear

    from nemo_jetrl.vllm_patch.dense_shards import rank_expected

    assert "vLLM accepts the fused layer" in _words(LLAMA_1B, "k_proj")
    qkv = _build(
        lambda q: QKVParallelLinear(2048, 64, 32, 8, bias=False, quant_config=q, prefix="a")
    )
    assert qkv.allow_fp8_block_shape_mismatch and qkv.output_partition_sizes == [256, 64, 64]
    hf_k_scale = torch.arange(4 * 16, dtype=torch.float32).reshape(4, 16)  # k_proj [512, 2048]
    s = qkv.weight_scale_inv
    s.weight_loader(s, hf_k_scale, "k")  # vLLM's own loader: no error
    # rank 1 holds HF k rows 64..127 (HF scale row 0); vLLM gave it row 1 (HF rows 128..255)
    assert torch.equal(s.data[2], hf_k_scale[1]) and not torch.equal(s.data[2], hf_k_scale[0])
    with pytest.raises(RuntimeError):  # v's scale row does not fit the 3-row parameter
        s.weight_loader(s, hf_k_scale, "v")

    class Root(nn.Module):
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}  # noqa: RUF012

    root = Root()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([nn.Module()])
    root.model.layers[0].self_attn = nn.Module()
    root.model.layers[0].self_attn.qkv_proj = qkv
    name = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    with pytest.raises(ValueError, match=r"k_proj.weight_scale_inv: tensor-parallel rank 1 of 8 "
                       r"holds \[64, 128\) of dim 0, not on 128-blocks"):  # fmt: skip
        rank_expected(root, name, hf_k_scale)
