"""An FP8-KV-cache engine (``jetrl_kv``) on this CPU: run with the trainer's scales where vLLM
can, refused (never silently run in BF16) where it cannot.

Whether vLLM runs an FP8 KV cache here is asked of vLLM (``compat.cpu_fp8_kv_cache``: its CPU
attention's own ISA choice), never assumed. Where it can (vLLM >= 0.25 on x86 with AVX-512 or
AMX), the engine starts with an FP8 KV cache, takes calibrated q/k/v scales at refit, every
attention layer reads them back, and layer 0's attention output under four scale settings is
the float64 attention on K/V through the FP8 cache that those scales predict (kv_effect.py).
Where it cannot, behaviour differs by vLLM version:

* vLLM 0.25's and 0.32's CPU attention refuses an FP8 KV cache it cannot run (needs AVX-512 or
  AMX) with its own error at engine start.
* vLLM 0.20's CPU platform *replaces* ``kv_cache_dtype=fp8`` by the model dtype and only logs a
  warning (when chunked prefill and prefix caching are off; with either on it refuses). The
  trainer would then model an FP8 KV cache the rollout does not have, so ``VllmRolloutEngine``
  checks the dtype the engine really runs and refuses with ``KvCacheDtypeMismatch``.

Either way the patch is reverted afterwards. Runs after test_vllm_engine.py's engine is closed
(one patch per process).
"""

from __future__ import annotations

import math
import os

import kv_effect
import pytest
import torch
from vllm_fixtures import vllm_cpu_env

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_env():
    with vllm_cpu_env():
        yield


def test_our_fp8_kv_answer_is_vllms():
    """The predicate the local backend uses agrees with vLLM's CPU attention on this CPU."""
    import vllm

    from nemo_jetrl.vllm_patch.compat import cpu_fp8_kv_cache, release

    ok, why = cpu_fp8_kv_cache(head_size=128)
    if release(vllm.__version__) < (0, 21, 0):
        assert not ok and "no FP8 KV cache" in why
        return
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(torch.bfloat16, 32, 128, "fp8")
        vllm_ok = True
    except NotImplementedError:
        vllm_ok = False
    assert ok == vllm_ok, why
    # vLLM's own reading of the CPU: AVX-512 or AMX
    assert vllm_ok == (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())
    ok16, why16 = cpu_fp8_kv_cache(head_size=48)  # a multiple of 16 but not of 32: never
    assert not ok16 and "head_size divisible by 32" in why16


def test_jetrl_kv_engine_on_this_cpu(tmp_path, capfd, monkeypatch):
    import vllm
    from hf_models import save_tiny_llama, tiny_llama_128
    from test_vllm_engine import USER_KWARGS
    from vllm.platforms import current_platform

    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch.compat import cpu_fp8_kv_cache, engine_kv_cache_dtype, release
    from nemo_jetrl.vllm_patch.engine import KvCacheDtypeMismatch, VllmRolloutEngine
    from nemo_jetrl.vllm_patch.kernel import registered_kernel
    from nemo_jetrl.vllm_patch.refit import kv_scales
    from nemo_jetrl.vllm_patch.settings import ENV_VAR

    assert current_platform.is_cpu()
    ok, _ = cpu_fp8_kv_cache(head_size=128)
    save_tiny_llama(tmp_path)
    # Chunked prefill and prefix caching off: the configuration in which vLLM 0.20 would run
    # the engine with a BF16 KV cache instead of refusing.
    kw = {**USER_KWARGS, "enable_chunked_prefill": False, "enable_prefix_caching": False}
    recipe = Recipe.preset("jetrl_kv")
    if ok:  # vLLM runs an FP8 KV cache here: the trainer's scales reach every attention layer
        scales = {0: {"q": 0.02, "k": 0.03125, "v": 0.0075}, 1: {"q": 0.5, "k": 0.25, "v": 0.1}}
        monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # kv_effect's closures
        with VllmRolloutEngine(tmp_path, recipe, engine_kwargs=kw) as eng:
            assert engine_kv_cache_dtype(eng.llm).startswith("fp8")
            rep = eng.refit(tiny_llama_128(1).state_dict(), kv_scales=scales)
            assert rep.kv_layers == (
                "model.layers.0.self_attn.attn",
                "model.layers.1.self_attn.attn",
            )
            held = kv_scales(eng.llm)
            for i, per in scales.items():
                got = held[f"model.layers.{i}.self_attn.attn"]
                for t, v in per.items():
                    assert got[t] == v and got[f"{t}_tensor"] == float(torch.tensor(v)), (i, t)
            gens = eng.generate([[1, 40, 41, 42]], max_tokens=4, temperature=0.0, seed=0)
            assert len(gens[0].token_ids) == 4
            assert all(math.isfinite(v) and v <= 0 for v in gens[0].logprobs)
            effect = kv_effect.run(
                eng,
                lambda: eng.generate([kv_effect.PROMPT], max_tokens=1, temperature=0.0, seed=0),
                head_dim=128,
            )
            # The scales change vLLM's attention output as FP8 K/V under them predict.
            assert kv_effect.problems(effect) == [], effect
        assert ENV_VAR not in os.environ and registered_kernel() is None  # patch reverted
        return
    if release(vllm.__version__) < (0, 21, 0):
        with pytest.raises(KvCacheDtypeMismatch) as ei:
            VllmRolloutEngine(tmp_path, recipe, engine_kwargs=kw)
        msg = str(ei.value)
        assert "kv_cache_dtype='fp8'" in msg and "kv_cache_dtype='auto'" in msg
    else:
        with pytest.raises(Exception) as ei:
            VllmRolloutEngine(tmp_path, recipe, engine_kwargs=kw)
        captured = capfd.readouterr()
        chain, exc = [], ei.value
        while exc is not None:
            chain.append(str(exc))
            exc = exc.__cause__ or exc.__context__
        text = "\n".join(chain) + captured.out + captured.err
        assert "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in text
    assert ENV_VAR not in os.environ and registered_kernel() is None  # patch reverted
