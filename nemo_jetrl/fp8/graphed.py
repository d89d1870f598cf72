"""CUDA graphs for a training linear at one micro-batch shape (`graph_linear`).

Why: at 8192 tokens an `Fp8BlockLinear` forward + backward is ~1 ms of GPU work on an H200 but
~2.2 ms of host work to enqueue (eight kernels, three cuBLASLt calls, ~60 Python calls;
benchmarks/gpu/results, run 7): the GPU waits on Python. A CUDA graph enqueues the same kernels
with one call. ``graph_linear(layer, sample)`` captures ``layer``'s forward and backward for
``sample``'s shape, dtype and device (any ``nn.Linear``: torch's BF16 one too, for a fair
baseline) and returns a module that replays them. What it keeps of the eager layer, and how:

* **Bits.** The captured kernels are the eager ones (the same plan, quantizers and GEMMs), so a
  replayed step has the eager step's bits (`tests/fp8/test_fp8_graphed_gpu.py`).
* **The weight is read live.** The FP8 weight is quantized inside the captured forward from the
  parameter's storage, so an optimizer step between replays is seen: the eager per-version
  cache is host code, which a replay does not run, and `linear._weight` skips it while any
  stream is being captured. Cost: one weight quantization per forward instead of per version.
* **Gradients are copies.** Each parameter's gradient, and ``dx`` where the input is a leaf, is
  returned as a copy of the graph's buffer. ``torch.cuda.make_graphed_callables`` returns views:
  autograd keeps a view as ``.grad`` when ``.grad`` was None, the next replay overwrites it, and
  a second micro-batch then counts its own gradient twice (`tests/fp8/test_fp8_graphed.py` shows
  the mechanism on CPU).
* **One micro-batch in flight.** The saved FP8 operands live in the graph, so a forward must be
  followed by its backward before this module's next forward; a backward whose forward was
  overwritten raises instead of computing a wrong gradient (capture one module per micro-batch
  in flight for pipeline schedules). The output is a copy (``static_output=False``); ``True``
  returns the graph's buffer itself, saving one ``[M, N]`` write, for callers that are done
  with an output before the next forward.
* **Non-finite input** is still flagged on the device: the graph's flags are handed back to
  `finite_flags` at every replay, so `check_non_finite` reads them as it reads the eager ones.
* **Refused** (ValueError naming the layer): an input of another shape, dtype, device or
  ``requires_grad`` than the sample's (one module per shape), parameters replaced or moved since
  the capture, frozen parameters, a layer or sample off CUDA. With grad disabled, or with the
  layer in the other train/eval mode than at capture, the eager layer runs (no backward needed).

The graphs' buffers (input, output, saved operands, gradients) live in their own memory pool for
the module's lifetime.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from nemo_jetrl.fp8 import finite_flags


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: GraphedLinear, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if x is not g._x:
            g._x.copy_(x)
        finite_flags.rearm(g._flags)
        g._fwd.replay()
        ctx.g, ctx.generation, ctx.leaf = g, g._generation, x.is_leaf
        return g._y.detach() if g.static_output else g._y.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        g: GraphedLinear = ctx.g
        if ctx.generation != g._generation:
            raise RuntimeError(
                f"graph_linear: {g.name}: this backward's forward was overwritten by a later "
                "forward (the graph holds one micro-batch's saved operands): run each "
                "micro-batch's backward before the next forward of this layer, or capture one "
                "graphed module per micro-batch in flight"
            )
        g._dy.copy_(dy)
        finite_flags.rearm(g._flags)
        g._bwd.replay()
        grads = list(g._grads)
        dx = None
        if g._x.requires_grad:  # a leaf's gradient is kept as .grad: a copy (module docstring)
            dx = grads.pop(0)
            dx = dx.clone() if ctx.leaf else dx.detach()
        return (None, dx, *(t.clone() for t in grads))


class GraphedLinear(nn.Module):
    """A linear layer's forward and backward captured at one input shape (`graph_linear`)."""

    def __init__(
        self,
        layer: nn.Linear,
        sample: torch.Tensor,
        *,
        warmup: int = 3,
        static_output: bool = False,
    ) -> None:
        super().__init__()
        name = str(getattr(layer, "name", type(layer).__name__))
        _check_layer(layer, sample, name, warmup)
        self.layer, self.name, self.static_output = layer, name, static_output
        self._params = tuple(p for p in (layer.weight, layer.bias) if p is not None)
        self._ptrs = tuple(p.data_ptr() for p in self._params)
        x = sample.detach().clone().requires_grad_(sample.requires_grad)
        self._spec = (tuple(x.shape), x.dtype, x.device, x.requires_grad)
        self._training, self._generation = layer.training, 0
        inputs = ((x,) if x.requires_grad else ()) + self._params
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with finite_flags.isolated() as flags:
            # kernels compiled, GEMMs planned, flags made: outside the capture
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    y = layer(x)
                    torch.autograd.grad(y, inputs, torch.ones_like(y))
            torch.cuda.current_stream(x.device).wait_stream(side)
            pool = torch.cuda.graph_pool_handle()
            self._fwd, self._bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._fwd, pool=pool):
                y = layer(x)
            dy = torch.empty_like(y)
            with torch.cuda.graph(self._bwd, pool=pool):
                grads = torch.autograd.grad(y, inputs, dy)
            self._flags = dict(flags)
        if self._flags:  # the warm-up's marks (a finite sample sets none)
            torch._foreach_zero_(list(self._flags.values()))
        self._x, self._y, self._dy, self._grads = x, y.detach(), dy, grads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or self.layer.training != self._training:
            return self.layer(x)
        spec = (tuple(x.shape), x.dtype, x.device, x.requires_grad)
        if spec != self._spec:
            raise ValueError(
                f"graph_linear: {self.name}: captured for input {_show(self._spec)}, got "
                f"{_show(spec)}: capture one graphed module per input shape, or call the layer"
            )
        if not _same_params(self.layer, self._params, self._ptrs):
            raise ValueError(
                f"graph_linear: {self.name}: the layer's parameters were replaced or moved "
                "since the capture (the graph reads the old storage): capture it again"
            )
        self._generation += 1
        return _Replay.apply(self, x, *self._params)


def _same_params(layer: nn.Module, params: tuple, ptrs: tuple) -> bool:
    """Whether ``layer`` still holds the captured parameter objects at the captured addresses
    (by identity: ``==`` on tensors would compare their elements)."""
    now = tuple(p for p in (layer.weight, layer.bias) if p is not None)
    return len(now) == len(params) and all(
        p is q and p.data_ptr() == ptr for p, q, ptr in zip(now, params, ptrs, strict=True)
    )


def _check_layer(layer: nn.Module, sample: torch.Tensor, name: str, warmup: int) -> None:
    if not isinstance(layer, nn.Linear):
        raise ValueError(
            f"graph_linear: {name}: needs an nn.Linear (Fp8BlockLinear or torch's), got "
            f"{type(layer).__name__}"
        )
    if warmup < 1:
        raise ValueError(f"graph_linear: {name}: warmup={warmup}: use 1 or more eager steps")
    frozen = [n for n, p in layer.named_parameters() if not p.requires_grad]
    if frozen:
        raise ValueError(
            f"graph_linear: {name}: parameters {frozen} do not require grad: the graph is a "
            "training step (call the layer itself for inference)"
        )
    if not (sample.is_cuda and layer.weight.is_cuda):
        raise ValueError(
            f"graph_linear: {name}: CUDA graphs need the layer and the sample on a CUDA device "
            f"(weight on {layer.weight.device}, sample on {sample.device})"
        )


def _show(spec: tuple) -> str:
    shape, dtype, device, grad = spec
    return f"{list(shape)} {str(dtype).removeprefix('torch.')} on {device}, requires_grad={grad}"


def graph_linear(
    layer: nn.Linear, sample: torch.Tensor, *, warmup: int = 3, static_output: bool = False
) -> GraphedLinear:
    """``layer``'s forward and backward captured in CUDA graphs for inputs shaped like
    ``sample`` (see the module docstring); ``warmup`` eager steps run first on a side stream."""
    return GraphedLinear(layer, sample, warmup=warmup, static_output=static_output)


__all__ = ["GraphedLinear", "graph_linear"]
