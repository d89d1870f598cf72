"""A refit keeps every tensor where a captured CUDA graph reads it (`vllm_patch.graph_bindings`).

No CUDA graph runs here: what a graph keeps is a tensor's storage address, so a reference held
from before the refit stands in for it (labelled below). The MLA stand-in rebinds ``W_UK_T`` /
``W_UV`` as vLLM 0.20.0's and 0.25.1's ``MLACommonImpl.process_weights_after_loading`` does
(``self.W_UK_T = W_UK.permute(1, 2, 0)``, read in their wheels, 2026-12-01).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_jetrl.vllm_patch import graph_bindings
from nemo_jetrl.vllm_patch.refit import RefitError

N, P, V, L = 4, 16, 8, 32  # heads, qk_nope, v head dim, kv_lora rank


class MlaStandin(torch.nn.Module):
    """kv_b_proj [N * (P + V), L] and the decode path's W_UK_T [N, P, L] / W_UV [N, L, V],
    derived as vLLM 0.20 / 0.25 derive them: new tensors at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.kv_b_proj = torch.nn.Linear(L, N * (P + V), bias=False)
        self.kv_cache = torch.zeros(3)  # vLLM binds the cache as a plain attribute: left alone

    def process_weights_after_loading(self) -> None:
        w = self.kv_b_proj.weight.detach().t().contiguous()  # [L, N * (P + V)]
        w_uk, w_uv = w.view(L, N, P + V).split([P, V], dim=-1)
        self.W_UV = w_uv.transpose(0, 1)  # [N, L, V]
        self.W_UK_T = w_uk.permute(1, 2, 0)  # [N, P, L]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(MlaStandin())
    m[0].process_weights_after_loading()
    return m


def refit(m: torch.nn.Module, seed: int) -> None:
    """What NeMo-RL's refit does to the layer: copy the new weight in, then process again."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m[0].kv_b_proj.weight.copy_(torch.randn(m[0].kv_b_proj.weight.shape, generator=g))
    m[0].process_weights_after_loading()


def expected(m: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    fresh = MlaStandin()
    fresh.kv_b_proj.weight.data = m[0].kv_b_proj.weight.detach().clone()
    fresh.process_weights_after_loading()
    return fresh.W_UK_T, fresh.W_UV


def test_without_it_a_graph_would_read_the_old_w_uk_t():
    """The hazard is real: after the stand-in's refit, the storage captured before (what a
    graph replays) no longer holds what the layer's W_UK_T holds."""
    m = model()
    captured = (m[0].W_UK_T, m[0].W_UV)  # stand-in for the graph's addresses
    refit(m, 1)
    assert m[0].W_UK_T is not captured[0]
    assert not torch.equal(captured[0], m[0].W_UK_T)
    assert not torch.equal(captured[1], m[0].W_UV)


def test_moved_tensors_go_back_into_the_captured_storage_with_the_new_values():
    m = model()
    captured = (m[0].W_UK_T, m[0].W_UV)
    ptrs = [t.data_ptr() for t in captured]
    before = graph_bindings.record(m)
    assert "kv_cache" not in before["0"]  # the KV cache is never touched
    refit(m, 1)
    kept = graph_bindings.keep_in_place(m, before)
    assert sorted(kept) == ["0.W_UK_T", "0.W_UV"]  # the weight was copied into: not moved
    uk_t, uv = expected(m)
    assert m[0].W_UK_T is captured[0] and m[0].W_UV is captured[1]
    assert [t.data_ptr() for t in (m[0].W_UK_T, m[0].W_UV)] == ptrs
    assert torch.equal(captured[0], uk_t) and torch.equal(captured[1], uv)
    # a second refit: still the same storage, the newest values
    before = graph_bindings.record(m)
    refit(m, 2)
    graph_bindings.keep_in_place(m, before)
    uk_t, _ = expected(m)
    assert m[0].W_UK_T is captured[0] and torch.equal(captured[0], uk_t)


def test_a_parameter_replaced_by_a_new_one_keeps_its_object_and_storage():
    m = model()
    param = m[0].kv_b_proj.weight
    ptr = param.data_ptr()
    before = graph_bindings.record(m)
    new = torch.randn(param.shape)
    m[0].kv_b_proj.weight = torch.nn.Parameter(new.clone(), requires_grad=False)
    assert graph_bindings.keep_in_place(m, before) == ["0.kv_b_proj.weight"]
    assert m[0].kv_b_proj.weight is param and param.data_ptr() == ptr
    assert torch.equal(param, new)
    # a Parameter re-made around the same storage (vLLM's linear methods do) did not move
    before = graph_bindings.record(m)
    m[0].kv_b_proj.weight = torch.nn.Parameter(param.data, requires_grad=False)
    assert graph_bindings.keep_in_place(m, before) == []


def test_a_tensor_rebound_to_another_layout_is_refused_by_name():
    m = model()
    before = graph_bindings.record(m)
    m[0].W_UK_T = m[0].W_UK_T.contiguous()  # same values and shape, other strides
    with pytest.raises(RefitError, match=r"(?s)0\.W_UK_T: \(4, 16, 32\).*stride.*enforce_eager"):
        graph_bindings.keep_in_place(m, before)


def _config(device_eager: bool, mode: str | None) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=device_eager),
        compilation_config=SimpleNamespace(
            cudagraph_mode=None if mode is None else SimpleNamespace(name=mode)
        ),
    )


@pytest.mark.parametrize(
    ("device", "eager", "mode", "want"),
    [
        ("cuda", False, "FULL_AND_PIECEWISE", True),
        ("cuda", False, "PIECEWISE", True),  # piecewise graphs capture the linears' weights
        ("cuda", False, "NONE", False),
        ("cuda", True, "FULL_AND_PIECEWISE", False),
        ("cuda", False, None, False),
        ("cpu", False, "FULL_AND_PIECEWISE", False),
    ],
)
def test_which_engines_replay_captured_graphs(device, eager, mode, want):
    got = graph_bindings.captures_cuda_graphs(_config(eager, mode), torch.device(device))
    assert got is want


@pytest.mark.vllm
def test_every_cudagraph_mode_of_the_installed_vllm_is_judged():
    """vLLM's own enum: NONE replays nothing, every other mode replays captured graphs."""
    from vllm.config.compilation import CUDAGraphMode

    for mode in CUDAGraphMode:
        cfg = SimpleNamespace(
            model_config=SimpleNamespace(enforce_eager=False),
            compilation_config=SimpleNamespace(cudagraph_mode=mode),
        )
        got = graph_bindings.captures_cuda_graphs(cfg, torch.device("cuda"))
        assert got is (mode.name != "NONE"), mode


def _worker(m: torch.nn.Module) -> SimpleNamespace:
    cfg = _config(False, "FULL_AND_PIECEWISE")
    cfg.parallel_config = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1)
    return SimpleNamespace(model_runner=SimpleNamespace(model=m), vllm_config=cfg)


@pytest.mark.parametrize("rebind_layout", [False, True], ids=["new_values", "new_layout"])
def test_nemo_rls_hooked_transport_keeps_graph_storage_or_refuses_and_rolls_back(
    monkeypatch, rebind_layout
):
    """NeMo-RL's transport as our hook wraps it, on an engine that replays CUDA graphs (the
    device test is a GPU's: stood in by the predicate, labelled). Its refit rebinds W_UK_T /
    W_UV as vLLM 0.20 / 0.25 do: the captured storage gets the new values; a rebind to another
    layout is refused and the layer rolled back."""
    from nemo_jetrl.backends.nemo_rl.vllm_refit import HookState, _make_transport
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import settings_from_recipe

    monkeypatch.setattr(graph_bindings, "captures_cuda_graphs", lambda cfg, device: True)
    m = model()
    captured = m[0].W_UK_T
    old = captured.clone()

    def nemo_rl_transport(worker) -> bool:
        refit(worker.model_runner.model, 1)
        if rebind_layout:
            worker.model_runner.model[0].W_UK_T = worker.model_runner.model[0].W_UK_T.contiguous()
        return True

    state = HookState(settings_from_recipe(Recipe.preset("jetrl")), False, True, "test")
    hooked = _make_transport("update_weights_via_ipc_zmq", nemo_rl_transport, state)
    if not rebind_layout:
        assert hooked(_worker(m)) is True
        assert m[0].W_UK_T is captured and torch.equal(captured, expected(m)[0])
        return
    with pytest.raises(RefitError, match=r"(?s)0\.W_UK_T.*rolled back"):
        hooked(_worker(m))
    assert m[0].W_UK_T is captured and torch.equal(captured, old)


@pytest.mark.gpu
def test_a_real_cuda_graph_replays_the_refit_weights():
    """On a GPU, the claim itself: a CUDA graph captured before the refit (decode's W_UK_T
    bmm) replays the refit's values after `keep_in_place`, bit for bit with eager; without it
    the replay differs (the graph reads the old storage)."""
    dev = torch.device("cuda")
    results = {}
    for keep in (False, True):
        m = model().to(dev)
        m[0].process_weights_after_loading()
        q = torch.randn(N, 8, P, device=dev)
        out = torch.empty(N, 8, L, device=dev)
        w = m[0].W_UK_T
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.bmm(q, w, out=out)  # warm-up off the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.bmm(q, m[0].W_UK_T, out=out)
        del w
        before = graph_bindings.record(m)
        refit(m, 1)
        if keep:
            graph_bindings.keep_in_place(m, before)
        del before
        graph.replay()
        torch.cuda.synchronize()
        results[keep] = torch.equal(out, torch.bmm(q, m[0].W_UK_T))
    assert results == {False: False, True: True}, results


class AttnStandin(torch.nn.Module):
    """A vLLM attention layer's scales as it holds them: q/k/v_scale parameters made under the
    model's default dtype (bf16), the float32 ``_k_scale`` its kernels read, the host float."""

    def __init__(self) -> None:
        super().__init__()
        for t in "qkv":
            setattr(
                self,
                f"{t}_scale",
                torch.nn.Parameter(torch.tensor(1.0, dtype=torch.bfloat16), requires_grad=False),
            )
            setattr(self, f"_{t}_scale", torch.tensor(1.0))
            setattr(self, f"_{t}_scale_float", 1.0)


def test_the_refit_of_bf16_kv_scale_parameters_is_not_taken_for_a_graph_rebinding(monkeypatch):
    """NeMo-RL sends calibrated KV scales; our batch path widens the bf16 ``k_scale``
    parameter to float32 (a new storage). The hook widens them before recording, so on an
    engine replaying graphs the refit passes (found by review: it was refused at every refit
    with an FP8 KV cache)."""
    from nemo_jetrl.backends.nemo_rl.refit_batches import quantize_batch
    from nemo_jetrl.backends.nemo_rl.vllm_refit import HookState, _make_transport
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import settings_from_recipe

    monkeypatch.setattr(graph_bindings, "captures_cuda_graphs", lambda cfg, device: True)
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([torch.nn.Module()])
    m.layers[0].self_attn = torch.nn.Module()
    m.layers[0].self_attn.attn = AttnStandin()
    m.layers[0].self_attn.o_proj = torch.nn.Linear(4, 4)
    settings = settings_from_recipe(Recipe.preset("jetrl_kv"))

    def nemo_rl_transport(worker) -> bool:
        batch = [("layers.0.self_attn.k_scale", torch.tensor([0.25]))]
        for name, t in quantize_batch(batch, m, settings, worker.model_runner._jetrl_sent):
            # vLLM's loader: "<layer>.self_attn.k_scale" -> the attention's parameter, in place
            m.layers[0].self_attn.attn.get_parameter(name.rpartition(".")[2]).data.copy_(t[0])
        return True

    state = HookState(settings, False, True, "test")
    hooked = _make_transport("update_weights_via_ipc_zmq", nemo_rl_transport, state)
    assert hooked(_worker(m)) is True
    k = m.layers[0].self_attn.attn.k_scale
    assert k.dtype == torch.float32 and float(k) == 0.25
