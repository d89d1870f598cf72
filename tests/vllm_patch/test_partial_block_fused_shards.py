"""A fused vLLM layer's shard starting off a 128-block edge (issue 39): refused by name.

STAND-IN (labelled): a torch module shaped like the vLLM layers `worker_ext.resolve_hf_name`
reads (``packed_modules_mapping``, ``logical_widths``, the fused parameters); no engine needed.
DeepSeek-V3's ``fused_qkv_a_proj`` = q_a_proj (1536 rows) + kv_a_proj_with_mqa (576): the
576-row shard starts on block 12 and its 5 scale rows (a 64-row tail) are its own. Qwen3.5's
``in_proj_ba`` = in_proj_b (32 rows) + in_proj_a (32): in_proj_a starts at row 32, inside
in_proj_b's block, so the two would share scales that training keeps apart.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nemo_jetrl.vllm_patch.worker_ext import resolve_hf_name


def _model(fused: str, shards: list[str], widths: list[int], k: int = 256) -> nn.Module:
    layer = nn.Module()
    rows = sum(widths)
    layer.weight = nn.Parameter(torch.zeros(rows, k), requires_grad=False)
    layer.weight_scale_inv = nn.Parameter(torch.ones(-(-rows // 128), -(-k // 128)))
    layer.logical_widths = widths
    attn = nn.Module()
    setattr(attn, fused, layer)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].attn = attn
    root = nn.Module()
    root.model = model
    root.packed_modules_mapping = {fused: shards}
    return root


def test_a_576_row_shard_after_whole_blocks_gets_its_own_scale_rows():
    m = _model("fused_qkv_a_proj", ["q_a_proj", "kv_a_proj_with_mqa"], [1536, 576])
    name, _, start, rows = resolve_hf_name(
        m, "model.layers.0.attn.kv_a_proj_with_mqa.weight_scale_inv"
    )
    assert name.endswith("fused_qkv_a_proj.weight_scale_inv") and (start, rows) == (12, 5)
    assert resolve_hf_name(m, "model.layers.0.attn.kv_a_proj_with_mqa.weight")[2:] == (1536, 576)


def test_a_shard_starting_inside_a_block_is_refused_naming_it():
    m = _model("in_proj_ba", ["in_proj_b", "in_proj_a"], [32, 32])
    assert resolve_hf_name(m, "model.layers.0.attn.in_proj_b.weight_scale_inv")[2:] == (0, 1)
    with pytest.raises(ValueError, match=r"in_proj_a.weight_scale_inv: starts at row 32 of "
                       r"model.layers.0.attn.in_proj_ba, off a 128-row block edge.*in_proj_b"):  # fmt: skip
        resolve_hf_name(m, "model.layers.0.attn.in_proj_a.weight_scale_inv")
