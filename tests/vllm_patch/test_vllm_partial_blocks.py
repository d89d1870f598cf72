"""Partial 128-blocks on the real vLLM CPU engine under the jetrl patch (issue 39).

A Llama with hidden 576 (= 4*128 + 64, the row count of Moonlight's kv_a_proj_with_mqa):
o_proj and down_proj are 576-row projections (a 64-row tail block, ``weight_scale_inv`` 5 rows),
q/k/v and gate/up read K = 576 (a 64-wide tail group per token). vLLM loads them with
ceil-sized scale grids (tp=1: no split), the refit sends `quantize_blockwise`'s partial blocks,
and the parity check compares every tensor bit for bit. The MLA layers themselves
(kv_a_proj_with_mqa) are not served by this patch's refit yet (its FP8 set is q/k/v/o and
gate/up/down), so a dense model carries the shape here.
"""

from __future__ import annotations

import math

import pytest
import torch
from hf_models import char_tokenizer, tiny_hf_config, tiny_hf_model
from vllm_fixtures import served_checkpoint, vllm_cpu_env

pytestmark = pytest.mark.vllm

HIDDEN = 576
USER_KWARGS = dict(dtype="bfloat16", max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=0)


def tiny_llama_576(seed: int = 0) -> torch.nn.Module:
    cfg = tiny_hf_config(
        "llama", vocab_size=128, hidden_size=HIDDEN, intermediate_size=512,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, initializer_range=0.08,
    )  # fmt: skip
    return tiny_hf_model(cfg, seed=seed, dtype=torch.bfloat16)


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_env():
    with vllm_cpu_env():
        yield


@pytest.fixture(scope="module")
def recipe():
    from nemo_jetrl.recipe import Recipe

    return Recipe.preset("jetrl")


@pytest.fixture(scope="module")
def rollout(tmp_path_factory, recipe):
    d = tmp_path_factory.mktemp("tiny_llama_576")
    with served_checkpoint(tiny_llama_576(0), d, recipe, USER_KWARGS) as eng:
        yield eng


def test_576_row_weights_are_quantized_with_a_tail_block(recipe):
    from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise
    from nemo_jetrl.vllm_patch.refit import quantize_state_dict

    sd = tiny_llama_576(1).state_dict()
    q = quantize_state_dict(sd, recipe).tensors
    o = "model.layers.0.self_attn.o_proj"
    assert q[f"{o}.weight_scale_inv"].shape == (5, 2)  # 576 rows: 4 whole blocks + 64 rows
    assert q["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (5, 4)
    assert q["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 5)  # K tail
    want = quantize_blockwise(sd[f"{o}.weight"], (128, 128), pow2_scales=True)
    assert torch.equal(fp8_bits(q[f"{o}.weight"]), fp8_bits(want.data))


def test_every_partial_block_linear_runs_our_kernel_and_parity_holds(rollout, recipe):
    from nemo_jetrl.vllm_patch.refit import refit

    llm = rollout.llm
    kernels = llm.collective_rpc("jetrl_kernels")[0]
    fp8 = {n: k for n, k in kernels.items() if n.startswith("model.layers.")}
    assert len(fp8) == 8 and set(fp8.values()) == {"JetRLFp8BlockLinearKernel"}
    assert rollout.last_refit is not None and rollout.last_refit.parity.differing == ()
    report = refit(llm, tiny_llama_576(1).state_dict(), recipe)
    assert report.parity is not None and report.parity.fp8 == 2 * 14
    assert report.parity.compared == 2 * 14 + 7  # + embed, 4 norms, final norm, lm_head
    assert report.parity.differing == ()


def test_generation_runs_and_a_refit_changes_it(rollout, recipe):
    from nemo_jetrl.vllm_patch.refit import refit

    tok = char_tokenizer()
    prompts = [tok.encode(p) for p in ("Hello wor", "The cat s")]
    outs = []
    for seed in (2, 3):
        refit(rollout.llm, tiny_llama_576(seed).state_dict(), recipe)
        gens = rollout.generate(prompts, max_tokens=6, temperature=0.0, ignore_eos=True)
        for g in gens:
            assert len(g.token_ids) == len(g.logprobs) == 6
            assert all(math.isfinite(v) and v <= 0.0 for v in g.logprobs)
        outs.append([g.logprobs for g in gens])
    assert outs[0] != outs[1]
