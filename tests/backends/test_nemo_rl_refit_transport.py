"""The hooked NeMo-RL refit transport's bookkeeping on a single-rank stand-in engine (no vLLM):
a rolled-back refit keeps no KV scales for the wake-up, the rollback snapshot's copies are
released even while a raised error's traceback lives, and a vote that cannot be held restores
this rank and says the engine must restart. The multi-rank vote runs on a real TP=2 vLLM CPU
engine (tests/vllm_patch/test_vllm_dense_shards.py)."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch

from nemo_jetrl.backends.nemo_rl import vllm_refit
from nemo_jetrl.backends.nemo_rl.refit_batches import quantize_batch
from nemo_jetrl.backends.nemo_rl.vllm_refit import HookState, _make_load_weights, _make_transport
from nemo_jetrl.recipe import Recipe
from nemo_jetrl.vllm_patch import rank_vote, settings_from_recipe
from nemo_jetrl.vllm_patch.refit import RefitError
from nemo_jetrl.vllm_patch.rollback import RollbackError


class Attn(torch.nn.Module):
    """A vLLM attention layer's scales: bf16 parameters, the float32 tensors, host floats."""

    def __init__(self) -> None:
        super().__init__()
        for t in "qkv":
            p = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.bfloat16), requires_grad=False)
            setattr(self, f"{t}_scale", p)
            setattr(self, f"_{t}_scale", torch.tensor(1.0))
            setattr(self, f"_{t}_scale_float", 1.0)


def engine() -> SimpleNamespace:
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([torch.nn.Module()])
    m.layers[0].self_attn = torch.nn.Module()
    m.layers[0].self_attn.attn = Attn()
    m.layers[0].self_attn.o_proj = torch.nn.Linear(4, 4)
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=True),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )
    return SimpleNamespace(model_runner=SimpleNamespace(model=m), vllm_config=cfg)


SETTINGS = settings_from_recipe(Recipe.preset("jetrl_kv"))


def transport(k_scale: float, fail: bool):
    """NeMo-RL's transport stand-in: loads a k scale and o_proj's weight, then (``fail``)
    returns False as NeMo-RL's does when its receive loop caught an error."""

    def nemo_rl_transport(worker) -> bool:
        m = worker.model_runner.model
        batch = [("layers.0.self_attn.k_scale", torch.tensor([k_scale]))]
        for name, t in quantize_batch(batch, m, SETTINGS, worker.model_runner._jetrl_sent):
            m.layers[0].self_attn.attn.get_parameter(name.rpartition(".")[2]).data.copy_(t[0])
        with torch.no_grad():
            m.layers[0].self_attn.o_proj.weight.add_(1.0)
        return not fail

    state = HookState(SETTINGS, False, True, "test")
    return _make_transport("update_weights_via_ipc_zmq", nemo_rl_transport, state)


def test_a_rolled_back_refit_keeps_no_kv_scales_for_the_wake_up():
    w = engine()
    assert transport(0.25, fail=False)(w) is True
    assert w.model_runner._jetrl_kv_scales == {"layers.0.self_attn.attn": {"k": 0.25}}
    weight = w.model_runner.model.layers[0].self_attn.o_proj.weight.detach().clone()
    assert transport(0.5, fail=True)(w) is False
    # the engine holds the first refit, and the wake-up would write back its scale, not 0.5
    assert w.model_runner._jetrl_kv_scales == {"layers.0.self_attn.attn": {"k": 0.25}}
    assert float(w.model_runner.model.layers[0].self_attn.attn.k_scale) == 0.25
    assert torch.equal(w.model_runner.model.layers[0].self_attn.o_proj.weight, weight)


def test_the_snapshots_copies_are_released_while_the_error_lives(monkeypatch):
    copies = []
    take = vllm_refit.take_snapshot

    def spy(model, runner=None, **kw):
        snap = take(model, runner, **kw)
        copies.extend(
            weakref.ref(s.copy) for st in snap.modules.values() for s in st.tensors.values()
        )
        return snap

    monkeypatch.setattr(vllm_refit, "take_snapshot", spy)
    w = engine()

    def refused(worker) -> bool:
        raise RefitError("stand-in refusal")

    hooked = _make_transport(
        "update_weights_via_ipc_zmq", refused, HookState(SETTINGS, False, True, "t")
    )
    with pytest.raises(RefitError, match=r"(?s)stand-in refusal.*rolled back") as info:
        hooked(w)
    assert copies and info.value.__traceback__ is not None  # the error (and its frames) live
    assert all(ref() is None for ref in copies), "the snapshot's copies outlive the refit"


def test_a_vote_that_cannot_be_held_restores_this_rank_and_asks_for_a_restart(monkeypatch):
    def broken(worker, outcome):
        raise RuntimeError("stand-in: gloo timed out")

    monkeypatch.setattr(rank_vote, "engine_outcomes", broken)
    w = engine()
    weight = w.model_runner.model.layers[0].self_attn.o_proj.weight.detach().clone()
    with pytest.raises(RollbackError, match=r"could not agree.*gloo timed out.*restored.*restart"):
        transport(0.25, fail=False)(w)
    assert torch.equal(w.model_runner.model.layers[0].self_attn.o_proj.weight, weight)
    assert not hasattr(w.model_runner, "_jetrl_kv_scales")


@pytest.mark.parametrize(
    ("fails", "step"),
    [
        ("float32_kv_scales", "its attention KV scales could not be widened to float32"),
        ("take_snapshot", "its rollback snapshot could not be taken"),
        ("record", "the storage its CUDA graphs read could not be recorded"),
    ],
)
def test_a_failure_before_loading_names_the_step_that_failed(monkeypatch, fails, step):
    from nemo_jetrl.vllm_patch import graph_bindings

    def boom(*args, **kwargs):
        raise MemoryError("stand-in: out of memory on this rank")

    monkeypatch.setattr(graph_bindings, "captures_cuda_graphs", lambda cfg, device: True)
    monkeypatch.setattr(graph_bindings if fails == "record" else vllm_refit, fails, boom)
    w = engine()
    weight = w.model_runner.model.layers[0].self_attn.o_proj.weight.detach().clone()
    with pytest.raises(RefitError, match="before loading: " + step + r".*MemoryError") as info:
        transport(0.25, fail=False)(w)
    named = [w for w in ("widened", "snapshot", "CUDA graphs") if w in str(info.value)]
    assert len(named) == 1 and named[0] in step, f"the message names another step: {named}"
    # the stand-in transport loads regardless; the snapshot (where one was taken) restores it
    if fails == "record":
        assert torch.equal(w.model_runner.model.layers[0].self_attn.o_proj.weight, weight)
    assert not hasattr(w.model_runner, "_jetrl_kv_scales")


@pytest.mark.parametrize(("parity", "rollback"), [(True, True), (False, True), (True, False)])
def test_a_pipeline_parallel_engine_is_refused_by_the_check_that_is_on(parity, rollback):
    """Refused after NeMo-RL's stream is received (raised before it, the trainer waited: v0.7.0's
    IPC send for its ACK, 120 s, the collective broadcast for ever), with nothing loaded."""
    w = engine()
    w.vllm_config.parallel_config.pipeline_parallel_size = 2
    weight = w.model_runner.model.layers[0].self_attn.o_proj.weight.detach().clone()
    received = []

    def nemo_rl_transport(worker):  # receives every batch; loads through our load_weights
        batch = [("layers.0.self_attn.o_proj.weight", torch.ones(4, 4))]
        received.append(len(batch))
        _make_load_weights(state)(batch, worker.model_runner)
        return True

    state = HookState(SETTINGS, parity, rollback, "t")
    hooked = _make_transport("update_weights_via_ipc_zmq", nemo_rl_transport, state)
    with pytest.raises(RefitError, match=r"pipeline_parallel_size=2: .*set it to 1") as info:
        hooked(w)
    assert received == [1]  # the stream was drained; every rank raises the same after it
    assert torch.equal(w.model_runner.model.layers[0].self_attn.o_proj.weight, weight)
    assert w.model_runner._jetrl_sent is None
    named = {k for k in rank_vote.CHECK_KEYS if k in str(info.value)}
    assert named == set(rank_vote.checks_on(parity=parity, rollback=rollback))
    assert ("jetrl.refit_parity_check" in named) is parity  # literal: the key a user sets


def test_a_pipeline_parallel_engine_runs_with_both_checks_off():
    w = engine()
    w.vllm_config.parallel_config.pipeline_parallel_size = 2
    state = HookState(SETTINGS, False, False, "t")
    assert _make_transport("update_weights_via_ipc_zmq", lambda wk: True, state)(w) is True


def test_the_snapshot_lands_before_nemo_rls_side_streams_load(monkeypatch):
    """NeMo-RL's packed-tensor loads run on fresh CUDA side streams that never wait for the
    default stream, where a GPU snapshot's copies queue behind an in-flight forward (vLLM's
    async scheduling): the device is synchronised between the two (a CUDA stand-in: the
    order of calls)."""
    calls = []
    take = vllm_refit.take_snapshot

    def snapshot(model, runner=None, **kw):
        calls.append("snapshot")
        return take(model, runner, **kw)

    monkeypatch.setattr(vllm_refit, "take_snapshot", snapshot)
    monkeypatch.setattr(vllm_refit, "sync_device", lambda model: calls.append("sync"))

    def nemo_rl_transport(worker) -> bool:
        calls.append("transport")
        return True

    state = HookState(SETTINGS, False, True, "t")
    assert _make_transport("update_weights_from_collective", nemo_rl_transport, state)(engine())
    i, j = calls.index("snapshot"), calls.index("transport")
    assert "sync" in calls[i:j], calls


def test_te_fp8_weights_sent_at_refit_are_refused_naming_fp8_param():
    """The last guard (before launch `tree_rules` refuses the config): TE's FP8 codes and
    their scales, as NeMo-RL main's worker sends them with fp8_param, are not quantized again."""
    name = "model.layers.0.self_attn.o_proj.weight"
    codes = torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
    batch = [(name, codes), (f"{name}_scale_inv", torch.ones(1, 1))]
    with pytest.raises(RefitError, match=rf"FP8 tensors \({name}\).*fp8_param=true.*set it"):
        quantize_batch(batch, engine().model_runner.model, SETTINGS, None)
    # the same weight in BF16 goes through (the control), into an engine holding it in FP8
    held = torch.nn.Module()
    held.model = engine().model_runner.model
    held.model.layers[0].self_attn.o_proj.weight = torch.nn.Parameter(codes, requires_grad=False)
    out = dict(quantize_batch([(name, codes.bfloat16())], held, SETTINGS, None))
    assert out[name].dtype == torch.float8_e4m3fn


def test_kv_scales_of_linear_attention_layers_are_not_loaded_or_kept():
    """A hybrid model (Qwen3-Next, Qwen3.5): NeMo-RL names q/k/v scales for every decoder layer,
    1.0 for its linear-attention ones, which have no ``self_attn`` in vLLM (0.20's loader drops
    them, 0.25's raises). They are not loaded, checked or restored at the KV wake-up; the
    attention layer's are."""
    from nemo_jetrl.backends.nemo_rl import kv_wake
    from nemo_jetrl.backends.nemo_rl.refit_batches import SentTensors, check_refit_parity

    worker = engine()
    m = worker.model_runner.model
    linear = torch.nn.Module()
    linear.linear_attn = torch.nn.Linear(4, 4)
    m.layers.insert(0, linear)  # layer 0 linear attention, layer 1 softmax attention
    batch = [
        (f"model.layers.{i}.self_attn.{t}_scale", torch.tensor([s]))
        for i, s in ((0, 1.0), (1, 0.5))
        for t in "kv"
    ]
    held = torch.nn.Module()
    held.model = m
    worker.model_runner.model = held
    sent = SentTensors()
    out = dict(quantize_batch(batch, held, SETTINGS, sent))
    assert sorted(out) == ["model.layers.1.self_attn.k_scale", "model.layers.1.self_attn.v_scale"]
    assert sent.kv == {"model.layers.1.self_attn.attn": {"k": 0.5, "v": 0.5}}
    for name, t in out.items():  # what vLLM's loader would do
        getattr(m.layers[1].self_attn.attn, name.rsplit(".", 1)[1]).data.copy_(t.reshape(()))
    check_refit_parity(worker, sent)  # no AttributeError: only the attention layer is read
    kv_wake.keep_kv_scales(worker.model_runner, sent.kv)
    assert kv_wake.restore_kv_scales(worker.model_runner) >= 1
    # a name whose decoder layer does not exist is still sent: the loader names it (control)
    stray = [("model.layers.7.self_attn.k_scale", torch.tensor([0.5]))]
    assert [k for k, _ in quantize_batch(stray, held, SETTINGS, None)] == [stray[0][0]]


@pytest.mark.parametrize("host", [True, False])
def test_the_rollback_copy_goes_where_the_launch_says(monkeypatch, host):
    """With vLLM colocated the launch asks for the rollback copy in host memory (NeMo-RL's
    trainer sizes its refit buffers from the GPU memory it saw free before our copy)."""
    asked = []
    take = vllm_refit.take_snapshot

    def snapshot(model, runner=None, **kw):
        asked.append(kw)
        return take(model, runner, **kw)

    monkeypatch.setattr(vllm_refit, "take_snapshot", snapshot)
    state = HookState(SETTINGS, False, True, "t", host_snapshot=host)
    assert _make_transport("update_weights_via_ipc_zmq", lambda w: True, state)(engine())
    assert asked == [{"host": host}]
