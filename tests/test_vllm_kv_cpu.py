"""An FP8-KV-cache engine (``jetrl_kv``) on this CPU: refused, never silently run in BF16.

Where the behaviour differs by vLLM version (real engines, vLLM CPU builds, marker ``vllm``):

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

import os
from pathlib import Path

import pytest
import torch
from vllm_fixtures import vllm_cpu_env

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_env():
    with vllm_cpu_env():
        yield


def _cpu_has_fp8_kv_attention() -> bool:
    flags = Path("/proc/cpuinfo").read_text()
    return " avx512f" in flags or torch.cpu._is_amx_tile_supported()


def test_fp8_kv_cache_engine_is_refused_on_this_cpu(tmp_path, capfd):
    import vllm
    from test_vllm_engine import USER_KWARGS, _hf_model, _tokenizer
    from vllm.platforms import current_platform

    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch.compat import release
    from nemo_jetrl.vllm_patch.engine import KvCacheDtypeMismatch, VllmRolloutEngine
    from nemo_jetrl.vllm_patch.kernel import registered_kernel
    from nemo_jetrl.vllm_patch.settings import ENV_VAR

    assert current_platform.is_cpu() and not _cpu_has_fp8_kv_attention(), (
        "this test describes CPUs without AVX-512/AMX (the project's machines)"
    )
    _hf_model(0).save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    # Chunked prefill and prefix caching off: the configuration in which vLLM 0.20 would run
    # the engine with a BF16 KV cache instead of refusing.
    kw = {**USER_KWARGS, "enable_chunked_prefill": False, "enable_prefix_caching": False}
    recipe = Recipe.preset("jetrl_kv")
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
