"""The patch under vLLM's torch.compile (the CPU build's default mode), not just eager.

Our quantizer and GEMM are opaque custom ops, so inductor compiles the rest of the model around
them. Slow (compilation), so marked ``slow`` too: ``bash scripts/test_vllm.sh --runslow``.
"""

from __future__ import annotations

import math

import pytest
import torch
from vllm_fixtures import vllm_cpu_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_env():
    with vllm_cpu_env():
        yield


def test_compiled_engine_runs_our_kernel_and_tracks_the_fp8_trainer(tmp_path, monkeypatch):
    import vllm.envs
    from hf_models import char_tokenizer, tiny_llama_128
    from test_vllm_engine import USER_KWARGS, _generate, _hf_logprobs
    from vllm import LLM

    from nemo_jetrl.fp8.config import Fp8LinearConfig
    from nemo_jetrl.fp8.convert import convert_to_fp8_training
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import apply_patches, build_engine_kwargs
    from nemo_jetrl.vllm_patch.refit import refit_from_checkpoint

    tiny_llama_128(0).save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    recipe = Recipe.preset("jetrl")
    ek = build_engine_kwargs(recipe, {**USER_KWARGS, "enforce_eager": False})
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: faster start
    try:
        with apply_patches(recipe):
            llm = LLM(model=str(tmp_path), **ek.kwargs)
            try:
                report = refit_from_checkpoint(llm, tmp_path, recipe)
                assert report.parity is not None and report.parity.fp8 == 28
                assert report.parity.compared == 28 + 7 and report.parity.through_kernel == 2
                kernels = llm.collective_rpc("jetrl_kernels")[0]
                assert {k for n, k in kernels.items() if n.startswith("model.layers.")} == {
                    "JetRLFp8BlockLinearKernel"
                }
                out = _generate(llm)
            finally:
                llm.llm_engine.engine_core.shutdown()
    finally:
        vllm.envs.disable_envs_cache()
    trainer = tiny_llama_128(0)
    convert_to_fp8_training(
        trainer, Fp8LinearConfig(pow2_scales=True), module_filter_fn=lambda m, n: n != "lm_head"
    )
    worst = 0.0
    for o in out:
        lps = [
            lp[t].logprob
            for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)
        ]
        assert all(math.isfinite(v) for v in lps)
        worst = max(worst, float((torch.tensor(lps) - _hf_logprobs(trainer, o)).abs().max()))
    # Same bound as the eager test (inductor's fused norms round BF16 differently).
    assert worst < 0.25, worst
