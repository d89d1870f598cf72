"""A real Megatron-Core GPTModel on CPU, for tests. Test-only shims, all reverted on exit.

megatron-core 0.16 runs on CPU with the *local* layer spec (``get_gpt_layer_local_spec``: plain
PyTorch linears, ``DotProductAttention``, no Transformer Engine) except for two CUDA calls on the
forward path, which are shimmed here and nowhere else:

1. ``torch.cuda.current_device()``: called when building the model (e.g. ``GPTModel`` allocates a
   buffer on it) -> returns ``"cpu"`` so those tensors land on the CPU.
2. ``tensor_parallel.get_cuda_rng_tracker().fork()``: ``DotProductAttention.forward`` forks the
   CUDA RNG state around attention dropout -> a no-op context (dropout is 0 in these tests, so no
   random numbers are drawn and nothing depends on the RNG stream).

Everything else is real: a single-rank gloo process group and ``parallel_state`` (TP=PP=1), the
model classes, RoPE, the q/k layernorm, attention and the MLP. Callers pass an explicit causal
``attention_mask`` ([b, 1, s, s] bool, True = masked), because Megatron's default mask is created
with ``device="cuda"``.
"""

from __future__ import annotations

import contextlib
import socket
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def megatron_cpu() -> Iterator[None]:
    """Single-rank process group + parallel_state + the two CUDA shims; all undone on exit."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    own_pg = not dist.is_initialized()
    if own_pg:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    parallel_state.initialize_model_parallel(1, 1)
    tracker = tp_random.get_cuda_rng_tracker()
    old_device = torch.cuda.current_device
    had_fork = "fork" in vars(tracker)
    old_fork = vars(tracker).get("fork")
    torch.cuda.current_device = lambda: "cpu"  # shim 1
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # shim 2
    try:
        yield
    finally:
        torch.cuda.current_device = old_device
        if had_fork:
            tracker.fork = old_fork
        else:
            del tracker.fork
        parallel_state.destroy_model_parallel()
        if own_pg:
            dist.destroy_process_group()


@dataclass(frozen=True)
class TinyGpt:
    """Dimensions of the test model: GQA (4 query heads, 2 KV groups), q/k norm, SwiGLU."""

    num_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int = 64
    ffn_hidden_size: int = 384
    vocab_size: int = 512
    max_seq: int = 64


def gpt_config_fields(dims: TinyGpt = TinyGpt()) -> dict[str, Any]:
    """``TransformerConfig`` fields of the test GPT's architecture (Qwen3-like: SwiGLU, RMSNorm,
    no biases): the one place it is spelled, for the CPU model below and the GPU tests' TE model."""
    return {
        "num_layers": dims.num_layers,
        "hidden_size": dims.hidden_size,
        "num_attention_heads": dims.num_attention_heads,
        "num_query_groups": dims.num_query_groups,
        "kv_channels": dims.kv_channels,
        "ffn_hidden_size": dims.ffn_hidden_size,
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "normalization": "RMSNorm",
        "add_bias_linear": False,
    }


def build_gpt(dims: TinyGpt = TinyGpt(), *, seed: int = 0, **config_fields: Any) -> torch.nn.Module:
    """A real ``megatron.core.models.gpt.GPTModel`` (local spec, RMSNorm, RoPE, fp32) on CPU."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        **gpt_config_fields(dims),
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        **config_fields,
    )
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=dims.vocab_size,
        max_sequence_length=dims.max_seq,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    # Megatron initialises norms to ones; random norms make the q/k norm observable in tests.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
    return model


def causal_mask(seq: int) -> torch.Tensor:
    """[1, 1, s, s] bool, True above the diagonal (masked), as Megatron's attention expects."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, vocab] of a full causal forward."""
    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    return model(ids, pos, attention_mask=causal_mask(s))


def te_block_dequant(t: torch.Tensor) -> torch.Tensor:
    """What TE's blockwise FP8 weight (128x128 blocks from row 0 of the tensor it holds, FP32
    scales) multiplies with, dequantized: the training side of the block-grid tests."""
    from nemo_jetrl.fp8 import quantize_blockwise

    return quantize_blockwise(t, (128, 128), fmt="e4m3", pow2_scales=False).dequantize(
        torch.float32
    )


def build_gated_delta_net(cfg: Any) -> torch.nn.Module:
    """Megatron-Core's real ``GatedDeltaNet`` (Qwen3.5 / Qwen3-Next linear attention) with plain
    column/row-parallel linears, inside `megatron_cpu`. Only its forward needs the FLA kernels,
    so ``HAVE_FLA`` is set for the constructor alone."""
    import megatron.core.ssm.gated_delta_net as gdn
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    saved, gdn.HAVE_FLA = gdn.HAVE_FLA, True
    try:
        return gdn.GatedDeltaNet(
            cfg,
            gdn.GatedDeltaNetSubmodules(
                in_proj=ModuleSpec(module=ColumnParallelLinear),
                out_proj=ModuleSpec(module=RowParallelLinear),
            ),
            layer_number=1,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )
    finally:
        gdn.HAVE_FLA = saved
