"""What the refit snapshot keeps when the engine lists empty tensors beside its KV cache
(vllm_patch/rollback.py).

vLLM's runner lists a placeholder ``torch.empty(0)`` for a layer without a cache (and a model's
repacked weights leave empty parameters behind); an empty tensor has no storage (address 0), so
it must never be taken for the cache by address: the model's own empty tensors are saved and
put back, and only the real cache is left alone. The cache here fails the test on any read
(test_rollback_unit's ``_KvRead``, standing in for vLLM's sleep-mode unmapped memory)."""

from __future__ import annotations

import torch
from test_rollback_unit import _bytes, _failed_refit, _kv, _model_with_kv_cache, _Runner

from nemo_jetrl.vllm_patch.rollback import restore_snapshot, take_snapshot


def test_empty_tensors_listed_beside_the_cache_do_not_hide_the_models_empty_tensors():
    model, runner, bound = _model_with_kv_cache()
    runner = _Runner([torch.empty(0), *runner.kv_caches, torch.empty(0, 8)])
    empty_param = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    model.a.weight_packed = empty_param  # a weight repacked elsewhere (empty here)
    model.b.register_buffer("_scratch", torch.empty(0, dtype=torch.int32))
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3))
    out_before, bytes_before = model(x), _bytes(model)

    snap = take_snapshot(model, runner)
    saved = {f"{m}.{n}" for m, st in snap.modules.items() for n in st.tensors}
    assert {"a.weight_packed", "b._scratch", "a.weight", "b.bias"} <= saved
    assert not {"a.kv_cache", "b.kv_cache", "b.state_cache"} & saved
    assert snap.kv.nbytes == 3 * 64 * 1024 * 128 * 4  # the three caches, nothing for the empties

    _failed_refit(model)
    model.a.weight_packed = torch.nn.Parameter(torch.ones(4, 4), requires_grad=False)  # repacked
    model.b._scratch = torch.arange(3, dtype=torch.int32)
    rep = restore_snapshot(model, snap)
    assert set(rep.removed) == {"a.weight_scale", "b.scratch"}
    assert model.a.weight_packed is empty_param and model.a.weight_packed.shape == (0,)
    assert model.b._scratch.shape == (0,) and "_scratch" in model.b._buffers
    after = _bytes(model)
    assert after.keys() == bytes_before.keys()
    assert all(torch.equal(v, bytes_before[k]) for k, v in after.items())
    assert model.a.kv_cache is bound["a.kv_cache"] and model.b.state_cache is bound["b.state_cache"]
    assert torch.equal(model(x), out_before)


def test_a_cache_sharing_storage_with_a_listed_tensor_is_left_alone_but_a_copy_is_saved():
    """Recognised by storage: a view of a listed cache is left alone; a tensor that merely has
    the cache's shape (another storage) is the model's and is saved."""
    model, runner, _ = _model_with_kv_cache()
    base = torch.zeros(2, 16)
    runner = _Runner([*runner.kv_caches, _kv(base)])
    model.a.cache_view = _kv(base[1:])  # same storage as the runner's fourth cache
    model.b.lookalike = torch.zeros(2, 16)  # same shape, its own storage
    snap = take_snapshot(model, runner)
    saved = {f"{m}.{n}" for m, st in snap.modules.items() for n in st.tensors}
    assert "b.lookalike" in saved and "a.cache_view" not in saved
