"""The refit rollback's snapshot on the real vLLM CPU engine holds the weights, not the KV cache
(issue 29, point 1).

vLLM binds each attention layer's cache as a plain tensor attribute (``kv_cache``); the snapshot
once copied it with the weights: on this engine (``VLLM_CPU_KVCACHE_SPACE=1``, vLLM 0.32) it held
1,075,120,976 bytes for a 2.5 MB BF16 checkpoint, and on a GPU whose cache sleeps during a
colocated refit it would read unmapped memory. Here the cache is hundreds of times the weights
and the snapshot must stay within twice the checkpoint's bytes; then every cache tensor is
replaced, in the worker, by one that raises on any read of its memory, and a snapshot, a refit
with other weights and the restore run through without touching it.
"""

from __future__ import annotations

import gc

import pytest
import torch
from hf_models import save_tiny_llama, tiny_llama_128
from test_vllm_engine import USER_KWARGS, _engine_state
from vllm_fixtures import vllm_cpu_env

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch.engine import VllmRolloutEngine

    d = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_llama(d)
    with vllm_cpu_env(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the test's worker closures
        eng = VllmRolloutEngine(d, Recipe.preset("jetrl"), engine_kwargs=USER_KWARGS)
        yield eng
        eng.close()
        gc.collect()


def _checkpoint_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in tiny_llama_128(0).state_dict().values())


def _worker_sizes(worker) -> dict[str, int]:  # runs in the worker (sent by value)
    from nemo_jetrl.vllm_patch.worker_ext import _model

    w = getattr(worker, "worker", worker)
    model = _model(w)
    params = {id(p): p for p in model.parameters()}
    kv = {id(t): t for t in w.model_runner.kv_caches}
    return {
        "params": sum(p.numel() * p.element_size() for p in params.values()),
        "kv": sum(t.numel() * t.element_size() for t in kv.values()),
        "layers": sum(
            1 for m in model.modules() if isinstance(m.__dict__.get("kv_cache"), torch.Tensor)
        ),
    }


def test_the_snapshot_is_a_small_multiple_of_the_weights_whatever_the_kv_cache(rollout):
    llm = rollout.llm
    sizes = llm.collective_rpc(_worker_sizes)[0]
    ckpt = _checkpoint_bytes()
    assert sizes["layers"] == 2 and sizes["kv"] > 100 * ckpt  # the premise: a large cache
    snap = llm.collective_rpc("jetrl_snapshot")[0]
    assert llm.collective_rpc("jetrl_drop_snapshot")[0]
    print(f"\ncheckpoint {ckpt} B, engine params {sizes['params']} B, KV cache {sizes['kv']} B, "
          f"snapshot {snap}")  # fmt: skip
    assert snap["kv_cache_bytes"] == sizes["kv"]  # recognised, by storage, without reading it
    assert sizes["params"] <= snap["bytes"] <= 2 * ckpt


def _plant(worker, on: bool) -> int:  # runs in the worker (sent by value)
    """Replace every KV-cache tensor (layers' ``kv_cache``, the runner's ``kv_caches``) by one
    over the same memory that raises on any op reaching it (``on``), or put the originals back."""
    from nemo_jetrl.vllm_patch.worker_ext import _model

    class KvRead(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise AssertionError(f"the KV cache was read ({func})")

    w = getattr(worker, "worker", worker)
    runner = w.model_runner
    layers = [
        m for m in _model(w).modules() if isinstance(m.__dict__.get("kv_cache"), torch.Tensor)
    ]
    if on:
        runner._test_kv = (list(runner.kv_caches), [m.kv_cache for m in layers])
        wrapped = {id(t): torch.Tensor._make_subclass(KvRead, t) for t in runner._test_kv[0]}
        runner.kv_caches[:] = [wrapped[id(t)] for t in runner._test_kv[0]]
        for m in layers:
            m.kv_cache = wrapped.get(
                id(m.kv_cache), torch.Tensor._make_subclass(KvRead, m.kv_cache)
            )
    else:
        saved, per_layer = runner.__dict__.pop("_test_kv")
        runner.kv_caches[:] = saved
        for m, t in zip(layers, per_layer, strict=True):
            m.kv_cache = t
    return len(layers)


def test_snapshot_refit_and_restore_never_read_the_kv_cache(rollout):
    """Fails before issue 29: ``jetrl_snapshot`` copied ``kv_cache`` (AssertionError from the
    planted cache, "the KV cache was read (aten.detach.default)")."""
    llm, recipe = rollout.llm, rollout.recipe
    before = _engine_state(llm, recipe)
    assert llm.collective_rpc(_plant, args=(True,))[0] == 2
    try:
        llm.collective_rpc("jetrl_snapshot")
        rep = rollout.refit(tiny_llama_128(7).state_dict(), rollback=False)  # other weights in
        assert rep.parity is not None and rep.parity.differing == ()
        restored = llm.collective_rpc("jetrl_restore")[0]  # checked bit for bit in the worker
    finally:
        llm.collective_rpc(_plant, args=(False,))
    assert restored["tensors"] > 0
    after = _engine_state(llm, recipe)
    assert after.keys() == before.keys()
    assert [n for n in before if not torch.equal(before[n], after[n])] == []
