"""`fp8.graphed` on CPU: what can be shown without a GPU (the replays themselves, their bits and
their speed: tests/fp8/test_fp8_graphed_gpu.py and benchmarks/gpu/bench_fp8_linear.py).

* why gradients are copies: an autograd Function returning a view of a static buffer (what
  ``torch.cuda.make_graphed_callables`` returns) becomes ``.grad`` itself, and a second
  micro-batch's replay then doubles its own gradient; a copy accumulates right (the control);
* the refusals, each naming the layer and what to change, before any work;
* the weight cache is skipped while a CUDA graph is captured (a replay runs no host code);
* the device flags a graph sets are handed back to `finite_flags` at each replay.
"""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.fp8 import Fp8BlockLinear, Fp8LinearConfig, finite_flags, graph_linear, linear
from nemo_jetrl.fp8.graphed import _same_params


def _micro_batches(copy: bool) -> torch.Tensor:
    """A weight's gradient after two micro-batches (true total: 1 + 2 = 3 per element) through a
    Function whose backward, like a graph replay, writes one static buffer."""
    static = torch.zeros(4)

    class Replayed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):  # type: ignore[override]
            return w * 1

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            static.copy_(g)  # the replay writes the graph's gradient buffer
            return static.clone() if copy else static.detach()

    w = torch.nn.Parameter(torch.ones(4))
    Replayed.apply(w).sum().backward()
    (Replayed.apply(w) * 2).sum().backward()
    return w.grad


def test_a_view_of_the_graphs_gradient_buffer_doubles_the_second_micro_batch():
    assert torch.equal(_micro_batches(copy=False), torch.full((4,), 4.0))  # 2 + 2, not 1 + 2
    assert torch.equal(_micro_batches(copy=True), torch.full((4,), 3.0))  # what graphed returns


def test_graph_linear_refuses_what_it_cannot_capture_by_name():
    layer = Fp8BlockLinear(256, 128, bias=True, dtype=torch.bfloat16, name="blk.qkv")
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"graph_linear: blk.qkv: CUDA graphs need the layer and "
                       r"the sample on a CUDA device \(weight on cpu, sample on cpu\)"):  # fmt: skip
        graph_linear(layer, x)
    with pytest.raises(ValueError, match=r"blk.qkv: warmup=0: use 1 or more eager steps"):
        graph_linear(layer, x, warmup=0)
    layer.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"blk.qkv: parameters \['bias'\] do not require grad"):
        graph_linear(layer, x)
    with pytest.raises(ValueError, match=r"graph_linear: GELU: needs an nn.Linear"):
        graph_linear(torch.nn.GELU(), x)  # type: ignore[arg-type]


def test_the_weight_cache_is_skipped_while_a_graph_is_captured(monkeypatch):
    layer = Fp8BlockLinear(256, 128, bias=False, config=Fp8LinearConfig(), name="blk.o")
    x = torch.randn(8, 256)
    layer(x)
    layer(x)
    assert layer.fp8_weight_cache.quantizations == 1  # eager: once per weight version
    layer.replan()  # the cache emptied (its count stays)
    monkeypatch.setattr(linear, "_capturing", lambda w: True)
    layer(x)
    layer(x)  # captured twice: the weight quantized inside each, nothing looked up or kept
    assert layer.fp8_weight_cache.quantizations == 1 and layer.fp8_weight_cache.qw is None
    monkeypatch.setattr(linear, "_capturing", lambda w: False)
    layer(x)
    assert layer.fp8_weight_cache.quantizations == 2 and layer.fp8_weight_cache.qw is not None


def test_a_graphs_flags_are_pending_again_after_each_replay(monkeypatch):
    monkeypatch.setattr(finite_flags, "_FLAGS", {})
    monkeypatch.setattr(finite_flags, "_SPARE", {})
    eager = finite_flags.flag("other", "cpu")
    with finite_flags.isolated() as made:
        assert finite_flags.pending() == 0  # the body starts with none pending
        buf = finite_flags.flag("blk.input", "cpu")
    graph_flags = dict(made)
    assert finite_flags.pending() == 1 and finite_flags.flag("other", "cpu") is eager  # restored
    finite_flags.rearm(graph_flags)
    assert finite_flags._FLAGS[("blk.input", torch.device("cpu"))] is buf
    buf.fill_(1)  # what a replay's quantizer stores for a non-finite input
    with pytest.raises(ValueError, match=r"\['blk.input'\]"):
        finite_flags.check_non_finite()
    assert int(buf) == 0 and finite_flags.pending() == 0  # read, zeroed, kept as a spare
    finite_flags.rearm(graph_flags)  # the next replay: the same buffer pending again
    assert finite_flags._FLAGS[("blk.input", torch.device("cpu"))] is buf
    assert ("blk.input", torch.device("cpu")) not in finite_flags._SPARE
    finite_flags.check_non_finite()
    other = finite_flags.flag("blk.input", "cpu")  # the layer run eagerly: its own buffer ...
    assert other is buf  # ... is the spare, the same one
    finite_flags._FLAGS[("blk.input", torch.device("cpu"))] = torch.zeros(1, dtype=torch.int32)
    finite_flags.rearm(graph_flags)  # another buffer pending under the name: both kept
    assert finite_flags._FLAGS[("blk.input (CUDA graph)", torch.device("cpu"))] is buf


def test_replaced_or_moved_parameters_are_told_apart_by_identity():
    """The check a replay runs before reading the captured storage: the same objects at the same
    addresses pass; a replaced parameter (equal values) or one whose ``.data`` was reassigned
    fails, and nothing compares tensors elementwise (that raised for a tuple of tensors)."""
    layer = torch.nn.Linear(8, 4)
    params = (layer.weight, layer.bias)
    ptrs = tuple(p.data_ptr() for p in params)
    assert _same_params(layer, params, ptrs)
    layer.bias = torch.nn.Parameter(layer.bias.detach().clone())  # equal values, new object
    assert not _same_params(layer, params, ptrs)
    layer.bias = params[1]
    layer.weight.data = layer.weight.data.clone()  # same object, new storage
    assert not _same_params(layer, params, ptrs)
    assert not _same_params(torch.nn.Linear(8, 4, bias=False), params, ptrs)
