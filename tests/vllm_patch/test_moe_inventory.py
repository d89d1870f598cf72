"""Launch and op inventory of one MoE layer forward of the serving kernel (`experts_forward`).

A `TorchDispatchMode` records every aten op of one forward (Qwen3-MoE-like routed experts, top-2,
expert 3 empty) on the Triton path (under Triton's CPU interpreter here, as the GPU would run
it); the Triton launches are recorded by wrapping the kernel modules, each launch run with the
recorder off (the interpreter copies its arguments around; a GPU does not). No vLLM needed.

What must be gone, each asserted: the BF16 gather of the routed rows (an aten index producing a
bf16 ``[T*k, H]``), a quantization of ``T*k`` rows instead of ``T``, the separate SiLU and
multiply (aten ``silu`` / bf16 ``mul``) with their own quantize launch, and fp32 atomics in the
combine (``index_add_``; now one combine launch reading the rows through a ``[T, k]`` table,
writing the model dtype). Today's code (696f711) recorded: launches quantize_kernel on [18, 256]
(T*k rows), grouped_rows_gemm, quantize_kernel, grouped_rows_gemm; aten silu 1, bf16 mul 1, bf16
index gathers 1, index_add 1; 72 aten ops in all (now 4 bf16/fp32 passes fewer, the integer
index ops of the fixed-order combine more).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from nemo_jetrl.fp8 import experts, finite_flags, triton_grouped, triton_kernels
from nemo_jetrl.fp8.quantize import quantize_reference
from nemo_jetrl.fp8.triton_launch import interpreting
from nemo_jetrl.vllm_patch.experts import experts_forward
from nemo_jetrl.vllm_patch.kernel import ensure_ops

pytestmark = [
    pytest.mark.triton,
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]
E, H, INTER, TOPK, T = 4, 256, 128, 2, 9
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the compiled kernels on a GPU


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.bf16_ops: Counter[str] = Counter()  # ops whose output is a bf16 tensor
        self.launches: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        self.ops[name] += 1
        if isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16:
            self.bf16_ops[name] += 1
        return out


class _Kernels:
    """A Triton kernel module whose ``*_kernel`` launches are recorded (name, first arg shape)."""

    def __init__(self, real: Any, rec: _Recorder) -> None:
        self._real, self._rec = real, rec

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._real, name)
        if not name.endswith("_kernel"):
            return fn
        rec = self._rec

        class _Grid:
            def __getitem__(self, grid: Any) -> Any:
                def launch(*args: Any, **kw: Any) -> Any:
                    rec.launches.append((name, tuple(args[0].shape)))
                    with _disable_current_modes():
                        return fn[grid](*args, **kw)

                return launch

        return _Grid()


def test_one_moe_layer_quantizes_tokens_once_fuses_silu_and_combines_without_atomics(
    monkeypatch,
):
    monkeypatch.setenv(experts.ENV_GROUPED_BACKEND, "triton")
    g = torch.Generator().manual_seed(0)
    q13 = [quantize_reference(torch.randn(2 * INTER, H, generator=g) * 0.05, (128, 128)) for _ in range(E)]  # fmt: skip
    q2 = [quantize_reference(torch.randn(H, INTER, generator=g) * 0.05, (128, 128)) for _ in range(E)]  # fmt: skip
    stack = lambda qs, f: torch.stack([getattr(q, f) for q in qs]).to(DEVICE)  # noqa: E731
    w13, s13, w2, s2 = stack(q13, "data"), stack(q13, "scale_inv"), stack(q2, "data"), stack(q2, "scale_inv")  # fmt: skip
    x = torch.randn(T, H, generator=g).bfloat16().to(DEVICE)
    ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [2, 1], [1, 0], [0, 1], [2, 0], [1, 2]])
    ids = ids.to(DEVICE)
    wts = torch.rand(T, TOPK, generator=g).to(DEVICE)
    ops = ensure_ops()
    rec = _Recorder()
    for mod in (triton_grouped, triton_kernels):
        wrapped = _Kernels(mod._kernels(), rec)
        monkeypatch.setattr(mod, "_kernels", lambda w=wrapped: w)
    run = lambda: experts_forward(  # noqa: E731
        ops, x, w13, s13, w2, s2, wts, ids, pow2=True, w_pow2=True, eps=0.0,
        backend="reference", expert_map=None,
    )  # fmt: skip
    run()  # tables made once per process (other tests may have made them), outside the count
    rec.launches.clear()
    with rec:
        out = run()
    finite_flags._FLAGS.clear()
    assert out.shape == (T, H) and bool(out.float().abs().sum() > 0)
    names = [n for n, _ in rec.launches]
    assert names == [
        "quantize_kernel", "grouped_rows_gemm_kernel", "silu_mul_quantize_kernel",
        "grouped_rows_gemm_kernel", "combine_kernel",
    ], rec.launches  # fmt: skip
    assert rec.launches[0][1] == (T, H)  # the tokens, quantized once (not T * top_k rows)
    assert rec.ops["silu"] == 0 and rec.bf16_ops["mul"] == 0  # SiLU*up is in the fused launch
    gathers = {k: v for k, v in rec.bf16_ops.items() if k in ("index", "index_select", "gather")}
    assert not gathers, gathers  # no BF16 gather of the routed rows
    assert rec.ops["index_add"] == 0 and rec.ops["index_add_"] == 0  # no fp32 atomics
    # The routing around the kernels, without expert parallelism (`sorted_routes`): sort the
    # ids, a row's token = its flat index // k, the weights gathered once, the expert offsets
    # (arange, searchsorted), the combine's by-token argsort. Before (d615bfb) a token table
    # was built and gathered (arange, repeat_interleave: unsqueeze, expand, clone; index): 45.
    real = {k: v for k, v in rec.ops.items() if k not in ("view", "detach", "_to_copy")}
    assert real == {"sort": 2, "floor_divide": 1, "index": 1, "arange": 1, "searchsorted": 1,
                    "new_empty": 1, "empty": 7}, real  # fmt: skip
    # With the views and the casts: 30 where the kernels are compiled (H200, run 8); Triton's CPU
    # interpreter adds 10: its GEMMs read FP8 codes through value tables (numpy has no FP8 type:
    # 4 uint8 views, 4 detaches) and store fp32, rounded to bf16 after (2 casts; `triton_grouped`).
    assert sum(rec.ops.values()) == (40 if interpreting() else 30), dict(rec.ops)
