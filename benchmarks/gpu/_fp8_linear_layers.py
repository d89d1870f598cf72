"""The layers `bench_fp8_linear.py` times, and how: the package's `Fp8BlockLinear` holding a
given weight, one forward + backward of a layer, the layer planned in each rowcol mode
(``JETRL_FP8_ROWCOL``: two passes, the default, or the fused kernel) eager and captured in CUDA
graphs by `fp8.graph_linear`, beside torch's BF16 linear captured the same way."""

from __future__ import annotations

import _common
import torch

ROWCOL_MODES = ("two_pass", "fused")  # `linear_plan.ENV_ROWCOL`'s values, each timed


def rowcol_ratio(modes: dict, bench) -> float | str:  # type: ignore[no-untyped-def]
    """Two passes' step time over the fused kernel's ('n/a' without a Triton rowcol step)."""
    if any(run is None for run in modes.values()):
        return "n/a"
    return bench(modes["two_pass"]) / bench(modes["fused"])


def fp8_layer(w: torch.Tensor, pow2: bool):
    """`Fp8BlockLinear` holding ``w`` (the trainer's FP8 layer)."""
    from nemo_jetrl.fp8 import Fp8BlockLinear, Fp8LinearConfig

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    return Fp8BlockLinear.from_linear(lin, Fp8LinearConfig(pow2_scales=pow2))


def fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """One forward + backward through ``layer`` (x needs grad: DGrad runs too)."""
    xr = x.detach().requires_grad_(True)

    def run():
        layer.zero_grad(set_to_none=True)
        xr.grad = None
        layer(xr).backward(dy)

    return run


def rowcol_mode(mode: str):  # type: ignore[no-untyped-def]
    """``JETRL_FP8_ROWCOL=mode`` while a layer plans (its first call), then as it was."""
    from nemo_jetrl.fp8.linear_plan import ENV_ROWCOL

    return _common.environ({ENV_ROWCOL: mode})


def gemm_backend(name: str):  # type: ignore[no-untyped-def]
    """``JETRL_FP8_GEMM_BACKEND=name`` while a layer plans its GEMMs, then as it was."""
    from nemo_jetrl.fp8.gemm_backends import ENV_GEMM_BACKEND

    return _common.environ({ENV_GEMM_BACKEND: name})


def default_rowcol() -> str:
    """The rowcol mode a layer plans with here (``$JETRL_FP8_ROWCOL`` or the package default)."""
    from nemo_jetrl.fp8.linear_plan import rowcol_two_pass

    return "two_pass" if rowcol_two_pass() else "fused"


def graphed_layers(w: torch.Tensor, x: torch.Tensor, pow2: bool):  # type: ignore[no-untyped-def]
    """({rowcol mode: `Fp8BlockLinear` planned with it}, torch's BF16 ``nn.Linear``), each
    holding ``w`` and captured in CUDA graphs for ``x``'s shape by `fp8.graph_linear` (the fixed
    micro-batch option): with the host out of the way, the rowcol choice is the GPU's time
    alone (the quantizer step: two passes took 0.75-0.78 of the fused kernel's time at 8192
    tokens on the H200, run 7)."""
    from nemo_jetrl.fp8 import graph_linear

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    sample = x.detach().requires_grad_(True)
    fp8 = {}
    for mode in ROWCOL_MODES:
        with rowcol_mode(mode):  # read when the layer plans: its first call, the warm-up
            fp8[mode] = graph_linear(fp8_layer(w, pow2), sample)
    return fp8, graph_linear(lin, sample)


def graphed_figures(w, x, dy, pow2: bool, bf16_ms: float, bench) -> dict:  # type: ignore[no-untyped-def]
    """The ``graphed_*`` columns (``graphed_ms``: the layer in this run's rowcol mode); a
    failure there is its row's text (printed) and the other figures of the run still come back."""
    try:
        fp8, bf16_graphed = graphed_layers(w, x, pow2)
        ms = {mode: bench(fwd_bwd(layer, x, dy)) for mode, layer in fp8.items()}
        default = default_rowcol()
        return {
            "graphed_ms": ms[default], "graphed_speedup": bf16_ms / ms[default],
            "bf16_graphed_ms": bench(fwd_bwd(bf16_graphed, x, dy)),
            "graphed_host_ms": _common.host_enqueue_ms(fwd_bwd(fp8[default], x, dy)),
            "graphed_two_pass/fused": ms["two_pass"] / ms["fused"],
        }  # fmt: skip
    except Exception as exc:  # the eager figures are the run's first business
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
        print(f"# graph_linear failed for [{x.shape[0]}, {w.shape[1]}] x {list(w.shape)}: {why}")
        keys = ("graphed_ms", "graphed_speedup", "bf16_graphed_ms", "graphed_host_ms",
                "graphed_two_pass/fused")  # fmt: skip
        return dict.fromkeys(keys, "failed")


def rowcol_step(w: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, pow2: bool, mode: str):  # type: ignore[no-untyped-def]
    """`fwd_bwd` of a layer planned with ``JETRL_FP8_ROWCOL=mode`` (``two_pass``: x and dy
    quantized by the 1x128 and the transposed 128x1 kernels in turn; ``fused``: by the rowcol
    kernel; the same bits). None where the layer has no Triton rowcol step (the CPU path)."""
    layer = fp8_layer(w, pow2)
    run = fwd_bwd(layer, x, dy)
    with rowcol_mode(mode):
        run()  # the layer plans on its first call, reading the variable
    plan = layer.fp8_state.plan
    return run if plan.fused_rowcol and plan.two_pass_rowcol == (mode == "two_pass") else None
