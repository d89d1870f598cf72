"""`worker_ext.checkpoint_shape` on layers shaped like vLLM's (no vLLM needed).

Found on an AVX2 CPU (AMD EPYC without AVX-512, 2026-11-29): vLLM 0.32's CPU build repacks the
MoE router's weight there (an empty ``weight``), so the refit parity check reads it back through
its GEMM and needs its shape; the router is a ``GateLinear`` (a ``ReplicatedLinear``) whose
``tp_size`` is the tensor-parallel size (2 in test_vllm_moe_shards' tp mode), and the shape was
refused ("GateLinear: unknown weight shape").
"""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.vllm_patch.worker_ext import checkpoint_shape


class ReplicatedLinear(torch.nn.Module):  # vLLM's attributes, as its LinearBase sets them
    def __init__(self, input_size: int, output_size: int, tp_size: int) -> None:
        super().__init__()
        self.input_size, self.output_size, self.tp_size = input_size, output_size, tp_size
        self.output_partition_sizes = [output_size]
        self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # repacked


class GateLinear(ReplicatedLinear):
    pass


class RowParallelLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_size_per_partition, self.output_size_per_partition = 64, 256
        self.input_size, self.output_size, self.tp_size = 128, 256, 2


class Unknown(torch.nn.Module):  # sharded, but no per-partition sizes to read
    def __init__(self) -> None:
        super().__init__()
        self.input_size, self.output_size, self.tp_size = 128, 256, 2


@pytest.mark.parametrize("tp", [1, 2])
def test_a_replicated_router_has_its_whole_shape_at_any_tp_size(tp):
    assert checkpoint_shape(GateLinear(2048, 128, tp)) == (128, 2048)
    assert checkpoint_shape(ReplicatedLinear(2048, 128, tp)) == (128, 2048)


def test_a_parallel_layer_reads_its_partition_and_an_unknown_one_is_refused():
    assert checkpoint_shape(RowParallelLinear()) == (256, 64)
    with pytest.raises(KeyError, match="Unknown: unknown weight shape"):
        checkpoint_shape(Unknown())
