"""`vllm_patch.rollback` on real torch modules and a real HF model (no vLLM needed): everything a
failed refit can do to a layer is undone bit for bit, object for object; a restore that does not
take is named. The real engines run it in tests/vllm_patch/test_vllm_cpu_gemm.py (vLLM) and
tests/backends/test_nemo_rl_refit_vllm.py (NeMo-RL's streamed refit)."""

from __future__ import annotations

import pytest
import torch
from hf_models import tiny_hf_config, tiny_hf_model

from nemo_jetrl.vllm_patch import rollback
from nemo_jetrl.vllm_patch.rollback import RollbackError, restore_snapshot, take_snapshot


class _Layer(torch.nn.Module):
    """The kinds of state a vLLM layer keeps: FP8 weight + fp32 scales (parameters), a buffer, a
    host tensor and a host float copy of a scale, a GEMM closure over a packed weight copy."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(256, 128, generator=g)
        self.weight = torch.nn.Parameter(w.to(torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(torch.rand(2, 1, generator=g) + 0.5)
        self.bias = torch.nn.Parameter(torch.randn(256, generator=g).to(torch.bfloat16))
        self.register_buffer("_k_scale", torch.tensor(0.25))
        self._k_scale_cpu = torch.tensor(0.25)
        self._k_scale_float = 0.25
        self.calculate_kv_scales = False
        packed = self.dequantized().t().contiguous()
        self.cpu_linear = lambda x: x @ packed

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale_inv.repeat_interleave(128, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cpu_linear(x) * self._k_scale_float + self.bias.float() + self._k_scale


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Layer(0), _Layer(1)
        self.embed = torch.nn.Embedding(16, 128)
        self.head = torch.nn.Linear(128, 16, bias=False)
        self.head.weight = self.embed.weight  # tied: saved once, restored once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.a(x)[:, :128] + self.b(x)[:, 128:])


def _bytes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone().reshape(-1).view(torch.uint8) for k, v in model.state_dict().items()
    }


def _failed_refit(model: _Model) -> None:
    """Everything a refit that failed half way may have done (what vLLM/NeMo-RL loaders do)."""
    a, b = model.a, model.b
    with torch.no_grad():
        a.weight.copy_(torch.full_like(a.weight, 3.0))  # in place
        a.weight_scale_inv.mul_(2)
        b.weight.data = torch.zeros(8, 8, dtype=torch.float8_e4m3fn)  # .data rebound
        b.bias = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))  # object replaced
        model.embed.weight.add_(1.0)  # tied with head
    a._k_scale.fill_(9.0)
    a._k_scale_cpu = torch.tensor(9.0)  # tensor attribute replaced
    a._k_scale_float = 9.0
    a.calculate_kv_scales = True
    packed = torch.ones(128, 256)
    a.cpu_linear = lambda x: x @ packed  # re-dispatched GEMM (new packed copy)
    a.weight_scale = torch.nn.Parameter(torch.ones(2, 1))  # added by processing
    b.scratch = "added"
    del b.calculate_kv_scales  # removed


def test_everything_a_failed_refit_did_is_undone_bit_for_bit():
    model = _Model().eval()
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(7))
    out_before, bytes_before = model(x), _bytes(model)
    ids_before = {n: (id(p), p.data_ptr()) for n, p in model.named_parameters()}
    closure = model.a.cpu_linear
    snap = take_snapshot(model)
    assert snap.device == torch.device("cpu")
    unique = {id(t): t for m in model.modules() for _, t in rollback.tensor_items(m).values()}
    assert snap.nbytes == sum(t.numel() * t.element_size() for t in unique.values())
    _failed_refit(model)
    assert not torch.equal(model(x), out_before)  # not vacuous: the refit changed the output

    rep = restore_snapshot(model, snap)
    assert set(rep.removed) == {"a.weight_scale", "b.scratch"}
    assert _bytes(model).keys() == bytes_before.keys()
    changed = [k for k, v in _bytes(model).items() if not torch.equal(v, bytes_before[k])]
    assert not changed
    assert {n: (id(p), p.data_ptr()) for n, p in model.named_parameters()} == ids_before
    assert model.a.cpu_linear is closure and model.a._k_scale_float == 0.25
    assert model.b.calculate_kv_scales is False and model.a.calculate_kv_scales is False
    assert model.head.weight is model.embed.weight
    assert torch.equal(model(x), out_before)


def test_a_restore_that_does_not_take_is_named(monkeypatch):
    model = _Model()
    snap = take_snapshot(model)
    _failed_refit(model)
    real = rollback._restore_module

    def skip_b(module, state, kv):  # the mutation: module "b" is not put back
        return [] if module is model.b else real(module, state, kv)

    monkeypatch.setattr(rollback, "_restore_module", skip_b)
    with pytest.raises(RollbackError) as ei:
        restore_snapshot(model, snap)
    msg = str(ei.value)
    assert "restart it" in msg
    assert "b.weight: other storage" in msg and "b.bias: another tensor object" in msg
    assert "b.calculate_kv_scales: attribute not restored" in msg
    assert "a." not in msg.replace("b.", "")  # "a" was restored


def test_a_restore_that_leaves_other_bytes_in_place_is_named(monkeypatch):
    """Same tensor object, same storage, one value off after the restore (e.g. a copy into a
    repacked layout that did not take): the bit-for-bit verification must catch it."""
    model = _Model()
    snap = take_snapshot(model)
    _failed_refit(model)
    real = rollback._restore_module

    def restore_then_corrupt(module, state, kv):
        out = real(module, state, kv)
        if module is model.a:
            with torch.no_grad():  # flip one byte of the (FP8) weight in place
                module.weight.view(torch.uint8).view(-1)[0] ^= 0x01
        return out

    monkeypatch.setattr(rollback, "_restore_module", restore_then_corrupt)
    with pytest.raises(RollbackError, match=r"a\.weight: values differ"):
        restore_snapshot(model, snap)


def test_snapshot_stays_on_the_gpu_only_when_it_leaves_the_reserve_free(monkeypatch):
    gpu = torch.device("cuda", 0)
    free = {"bytes": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free["bytes"], 80 << 30))
    need = 10 << 30
    free["bytes"] = need + (2 << 30)  # the 2 GiB reserve docs/vllm_patch.md states, a literal
    assert rollback.snapshot_device(need, gpu) == gpu
    free["bytes"] -= 1
    assert rollback.snapshot_device(need, gpu) == torch.device("cpu")
    assert rollback.snapshot_device(need, torch.device("cpu")) == torch.device("cpu")
    free["bytes"] = 80 << 30  # room to spare, but the caller wants host memory (colocated vLLM)
    assert rollback.snapshot_device(need, gpu) == gpu
    assert rollback.snapshot_device(need, gpu, host=True) == torch.device("cpu")


def test_a_real_hf_model_half_loaded_with_other_weights_is_restored():
    """A streamed refit refused after its first batches: half of another seed's tensors loaded."""
    cfg = tiny_hf_config("llama")
    model, other = tiny_hf_model(cfg, seed=0), tiny_hf_model(cfg, seed=1)
    ids = torch.arange(12).reshape(2, 6) % cfg.vocab_size
    with torch.no_grad():
        before = model(ids).logits
    snap = take_snapshot(model)
    sd = other.state_dict()
    half = dict(list(sd.items())[: len(sd) // 2])
    model.load_state_dict(half, strict=False)
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, before)
        rep = restore_snapshot(model, snap)
        assert rep.tensors >= len(sd) and rep.removed == ()
        assert torch.equal(model(ids).logits, before)


def test_the_rollback_benchmark_runs_and_refuses_a_missing_gpu():
    """benchmarks/bench_refit_rollback.py end to end on a tiny model (no timing claims here)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_refit_rollback.py"
    tiny = ["--hidden", "128", "--layers", "1", "--vocab", "256", "--repeats", "1"]
    run = subprocess.run([sys.executable, script, *tiny], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    rows = {line.split()[0]: line.split()[1:] for line in run.stdout.splitlines()[2:]}
    assert set(rows) == {"load", "snapshot", "restore"} and rows["load"][1] == "1.00"
    if not torch.cuda.is_available():
        gpu = subprocess.run([sys.executable, script, *tiny, "--device", "cuda"], text=True,
                             capture_output=True)  # fmt: skip
        assert gpu.returncode == 2 and "needs a CUDA GPU" in gpu.stderr


class _KvRead(torch.Tensor):
    """A KV cache that fails the test on any op that reaches its memory (clone, copy, .data,
    detach, view, compare...); metadata (shape, dtype, storage address) stays readable, as on a
    GPU whose cache vLLM's sleep mode unmapped."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"the KV cache was read ({func})")


def _kv(base: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(_KvRead, base)


class _Runner:
    """vLLM's model runner: ``kv_caches`` lists every layer's cache (compat.kv_cache_tensors)."""

    def __init__(self, kv_caches: list) -> None:
        self.kv_caches = kv_caches


def _model_with_kv_cache() -> tuple[_Model, _Runner, dict[str, object]]:
    """Every way vLLM binds its cache: ``kv_cache`` as a tensor (attention), as a tuple of
    views (mamba), and a tensor attribute by another name that only the runner's list names
    (same storage as a listed tensor, another object); large next to the weights."""
    model = _Model()
    big = [torch.zeros(64, 1024, 128) for _ in range(3)]  # 32 MiB each vs ~0.2 MiB of weights
    model.a.kv_cache = _kv(big[0])
    model.b.kv_cache = (_kv(big[1]), _kv(big[1]))
    model.b.state_cache = _kv(big[2])  # another object over the runner's third cache
    runner = _Runner([model.a.kv_cache, model.b.kv_cache[0], _kv(big[2])])
    bound = {"a.kv_cache": model.a.kv_cache, "b.kv_cache": model.b.kv_cache}
    bound["b.state_cache"] = model.b.state_cache
    return model, runner, bound


def test_snapshot_and_restore_never_read_the_kv_cache():
    """Fails on the snapshot that copied every tensor attribute (before issue 29): it cloned
    ``kv_cache`` (here: AssertionError "the KV cache was read"; on vLLM's CPU engine 1 GiB)."""
    model, runner, bound = _model_with_kv_cache()
    model.a.weight_packed = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # repacked
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(7))
    out_before, bytes_before = model(x), _bytes(model)

    snap = take_snapshot(model, runner)
    weights = {id(t): t for m in model.modules() for t in [*m.parameters(False), *m.buffers(False)]}
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert snap.kv.nbytes == 3 * 64 * 1024 * 128 * 4 > 100 * weight_bytes
    assert weight_bytes <= snap.nbytes <= weight_bytes + 64  # + the tensor attribute _k_scale_cpu
    saved = {f"{m}.{n}" for m, st in snap.modules.items() for n in st.tensors}
    assert "a.weight_packed" in saved  # an empty tensor is not mistaken for the cache
    assert not {"a.kv_cache", "b.kv_cache", "b.state_cache"} & saved

    _failed_refit(model)
    rep = restore_snapshot(model, snap)
    assert set(rep.removed) == {"a.weight_scale", "b.scratch"}  # the cache was not "added"
    after = _bytes(model)
    assert after.keys() == bytes_before.keys()
    assert all(torch.equal(v, bytes_before[k]) for k, v in after.items())
    assert model.a.kv_cache is bound["a.kv_cache"] and model.b.kv_cache is bound["b.kv_cache"]
    assert model.b.state_cache is bound["b.state_cache"]
    assert torch.equal(model(x), out_before)


def test_without_the_runner_a_cache_under_another_name_is_read():
    """The premise of the runner's list: a cache tensor bound by another name than ``kv_cache``
    is recognised only through the runner's ``kv_caches`` (by storage)."""
    model, _, _ = _model_with_kv_cache()
    with pytest.raises(AssertionError, match="the KV cache was read"):
        take_snapshot(model)
