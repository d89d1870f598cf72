"""Refit parity per rank with replicated KV heads: a real vLLM CPU engine at
``tensor_parallel_size=2`` serving a tiny block-FP8 Qwen3 with one KV head of 128 for 4 query
heads, so vLLM's ``QKVParallelLinear`` gives both ranks the same k/v rows
(``num_kv_head_replicas`` 2; NeMo-RL's Qwen3-235B at vLLM TP 8 has 4 KV heads on 8 ranks).
Each rank's q rows are its own, its k/v rows the whole of k/v: parity over every tensor passes on
both ranks and a byte flipped in rank 1's copy of k is named on rank 1 only. The other shard
rules: test_vllm_dense_shards.py (same helpers, one engine start here).
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
from hf_models import char_tokenizer, tiny_hf_config, tiny_hf_model
from test_vllm_dense_shards import USER, _env, _refit, settings  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_in_nemo_rl]


def tiny_qwen3_mqa(seed: int) -> torch.nn.Module:
    cfg = tiny_hf_config(
        "qwen3", vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1, head_dim=128, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.08,
    )  # fmt: skip
    return tiny_hf_model(cfg, seed=seed, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, settings):  # noqa: F811
    from safetensors.torch import save_file
    from vllm import LLM

    from nemo_jetrl.vllm_patch import apply_patches, build_engine_kwargs, verify_engine_kernels
    from nemo_jetrl.vllm_patch.engine_args import quantization_config
    from nemo_jetrl.vllm_patch.refit import quantize_state_dict
    from nemo_jetrl.vllm_patch.shutdown import shutdown_engine

    d = tmp_path_factory.mktemp("mqa_tp2")
    model = tiny_qwen3_mqa(0)
    sd = quantize_state_dict(model.state_dict(), settings, dtype=torch.bfloat16).tensors
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    cfg = dict(model.config.to_dict(), architectures=["Qwen3ForCausalLM"])
    cfg["quantization_config"] = quantization_config(settings)
    (d / "config.json").write_text(json.dumps(cfg))
    char_tokenizer().save_pretrained(d)
    patch = apply_patches(settings)
    engine = LLM(model=str(d), **build_engine_kwargs(settings, USER).kwargs)
    try:
        verify_engine_kernels(engine, settings)
        yield engine
    finally:
        shutdown_engine(engine)
        patch.revert()
        gc.collect()


def _qkv(self) -> tuple:
    """(rank, KV head replicas, qkv_proj weight shape) in each worker."""
    from vllm.distributed import get_tensor_model_parallel_rank

    qkv = self.model_runner.model.model.layers[0].self_attn.qkv_proj
    return get_tensor_model_parallel_rank(), qkv.num_kv_head_replicas, tuple(qkv.weight.shape)


def _flip_k_on_rank1(self) -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    rank = get_tensor_model_parallel_rank()
    if rank == 1:  # the rank's 256 q rows, then k (128), then v
        qkv = self.model_runner.model.model.layers[0].self_attn.qkv_proj
        qkv.weight.data.view(torch.uint8)[256 + 100, 11] ^= 2
    return rank


def test_replicated_kv_heads_parity_on_each_rank(llm, settings):  # noqa: F811
    from nemo_jetrl.vllm_patch.worker_ext import pack

    layout = [(r, n, tuple(shape)) for r, n, shape in llm.collective_rpc(_qkv)]
    assert layout == [(0, 2, (512, 256)), (1, 2, (512, 256))], layout
    new = {k: v.clone() for k, v in tiny_qwen3_mqa(1).state_dict().items()}
    blob = pack(new)
    res = llm.collective_rpc(_refit, args=(blob, settings.to_json()))
    print(f"parity per rank: {res}")
    for r in res:
        assert "error" not in r and r["compared"] == r["sent"] == len(new) + 7, r
        assert r["fp8"] == 14, r
    assert llm.collective_rpc(_flip_k_on_rank1) == [0, 1]
    r0, r1 = llm.collective_rpc(_refit, args=(blob, settings.to_json(), False))
    assert "error" not in r0, r0
    assert "model.layers.0.self_attn.k_proj.weight (1 of 32768 bytes differ)" in r1["error"], r1
    assert r1["error"].count("\n  - ") == 1, r1
