"""An FP8 MoE whose tensor-parallel expert shards are not 128-aligned is refused by name when
vLLM builds the layer (issue 28): a real vLLM CPU engine at ``tensor_parallel_size=2`` on a
tiny block-FP8 Qwen3-MoE with experts of width 128 (64 per rank). The engine with 128-aligned
shards is test_vllm_moe_shards.py."""

from __future__ import annotations

import re

import pytest
from test_vllm_moe_shards import (  # noqa: F401  (module fixtures, markers)
    USER,
    _env,
    pytestmark,
    settings,
    tiny_moe,
    write_fp8_checkpoint,
)


@pytest.fixture(scope="module", autouse=True)
def _vllm_logging_outside_capfd():
    """vLLM binds its log handler to sys.stdout at import: import it before capfd swaps that
    stream (else later log lines hit capfd's closed file)."""
    import vllm  # noqa: F401


def test_unaligned_tp_shard_refused_naming_layer_sizes_and_expert_parallel(
    tmp_path,
    settings,  # noqa: F811
    capfd,
):
    from vllm import LLM

    from nemo_jetrl.vllm_patch import apply_patches, build_engine_kwargs

    write_fp8_checkpoint(tiny_moe(0, inter=128), tmp_path, settings)
    kwargs = build_engine_kwargs(settings, dict(USER, load_format="auto")).kwargs
    with apply_patches(settings), pytest.raises(Exception, match="initialization failed"):
        LLM(model=str(tmp_path), **kwargs)
    logs = capfd.readouterr()
    text = logs.out + logs.err
    assert re.search(
        r"nemo_jetrl experts kernel cannot serve model\.layers\.1\.mlp\.experts\S*: tensor "
        r"parallel 2 gives each rank 64 of the expert intermediate size 128, not a multiple of "
        r"128",
        text,
    ), text[-3000:]
    assert "expert_parallel_size = tensor_parallel_size" in text
