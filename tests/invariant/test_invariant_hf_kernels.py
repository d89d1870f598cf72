"""The local backend's HF Llama made batch-invariant with `ops` on its Triton kernels (the path
CUDA tensors take): a token's logprob in a decode step has the same bits as in the full-sequence
training forward. Runs the kernels in Triton's CPU interpreter (dispatch ``triton``), so it checks
the wiring a GPU run uses: HF's masks, grouped KV heads, the KV-cache decode shapes, lm_head and
the log-softmax, through the same kernels."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_invariant_hf import _pair

from nemo_jetrl.backends.local.rollout import generate
from nemo_jetrl.backends.local.trainer import sequence_logprobs
from nemo_jetrl.invariant import dispatch

# slow: ~8 s of CPU (a jetrl model pair, then every kernel in the interpreter); the only test of
# HF's masks, grouped KV heads and cache shapes reaching the kernels as a GPU run does.
pytestmark = [pytest.mark.triton, pytest.mark.slow]


def test_decode_logprobs_equal_training_forward_on_the_kernels():
    train, roll = _pair("jetrl")
    gen = torch.Generator().manual_seed(11)
    prompts = torch.randint(3, 17, (2, 5), generator=gen)
    with dispatch.use_kernels("triton"), torch.no_grad():
        out = generate(
            roll, prompts, max_new_tokens=4, temperature=1.0, eos_id=2, pad_id=0, generator=gen
        )
        ids = torch.cat([prompts, out.response_ids], dim=1)
        lp = sequence_logprobs(train, ids, 5, 1.0)
        with dispatch.use_kernels("torch"):
            lp_torch = sequence_logprobs(train, ids, 5, 1.0)
    m = out.response_mask
    assert int(m.sum()) > 2
    diff = int((lp[m] != out.generation_logprobs[m]).sum())
    assert diff == 0, f"{diff} of {int(m.sum())} token logprobs differ"
    # the kernels did run: their bits are not the elementwise path's (close to them)
    assert not torch.equal(lp[m], lp_torch[m])
    assert torch.allclose(lp[m], lp_torch[m], atol=2e-2)
