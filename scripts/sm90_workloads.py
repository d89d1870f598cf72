"""The workloads of `sm90_census` and the fake H100 they run on (see its module docstring).

`pretend_h100` makes the host code take its H100 paths on CPU tensors: a labelled fake, only what
no CPU can give (the device's answers), for the census's own process. Each workload calls the
public entry points with the GPU call's shapes; no kernel runs (the census records the launches),
so the tensors are never read and their values do not matter.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

SM_COUNT = 132  # H100 SXM and H200


def pretend_h100() -> None:
    """Make the host code take its H100 paths on CPU tensors (`sm90_census`'s docstring, part
    1), for this process only: a script's setup, never a library call."""
    from nemo_jetrl.fp8 import (
        gemm_backends,
        triton_gemm,
        triton_kernels,
        triton_launch,
        triton_split,
    )

    torch.Tensor.is_cuda = property(lambda self: True)  # type: ignore[assignment, method-assign]
    props = SimpleNamespace(multi_processor_count=SM_COUNT, major=9, minor=0, name="census H100")
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_properties = lambda device=None: props
    torch.cuda.is_current_stream_capturing = lambda: False
    # The choices that read ``device.type`` (a CPU tensor's is "cpu" whatever is_cuda says).
    triton_split._dot_mode = lambda fmts, device: (
        triton_split._kernel().DOT_NATIVE.value
        if triton_gemm.native_dot(fmts, (9, 0))
        else triton_split._kernel().DOT_EMULATED.value
    )
    triton_split._pdl_capable = lambda device: True  # sm_90: programmatic dependent launch
    caps = gemm_backends.DeviceCaps(cuda=True, sm=(9, 0), scaled_mm=True, triton=True)
    gemm_backends.device_caps = lambda device: caps  # no DeepGEMM (the GPU image has none)
    triton_kernels.native_cast_default = lambda device_index: True
    for module in (triton_launch, triton_kernels):  # "a CPU tensor needs the interpreter"
        module._check_device = lambda x, label: None


QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
SERVING_M = (1, 8, 32, 64, 256, 8192)
BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


def _bench(name: str) -> ModuleType:
    """A GPU call script (benchmarks/gpu), imported as the call runs it: its model and token
    lists are the census's, so what the call launches is what the census compiles."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module(name)


def _unread(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)  # never read: no kernel runs


def serving() -> None:
    """Qwen3-8B's 4 linears as the vLLM layer serves them, both Triton backends, both modes."""
    from nemo_jetrl.fp8 import gemm_layouts, quantize_blockwise
    from nemo_jetrl.vllm_patch import kernel

    ops = kernel.ensure_ops()
    for backend in ("triton", "triton_splitk"):
        for pow2 in (True, False):
            for n, k in QWEN3_8B.values():
                qw = quantize_blockwise(
                    _unread(n, k), (128, 128), pow2_scales=pow2, check_finite=False
                )
                scale = gemm_layouts.gemm_ready_weight_scales(backend, qw.scale_inv)
                for m in SERVING_M:
                    kernel.serving_forward(ops, _unread(m, k), qw.data, scale, backend,
                                           torch.bfloat16, (pow2, pow2, 0.0))  # fmt: skip


def serving_sweep() -> None:
    """The split-K kernel's launch variants the GPU call times at the decode sizes
    (`bench_serving_kernel.py --backends split-sweep`, FP32 scales), through that script's own
    mode switch, so the packed cache holds them."""
    from nemo_jetrl.fp8 import gemm_layouts, quantize_blockwise
    from nemo_jetrl.vllm_patch import kernel

    bench, ops = _bench("bench_serving_kernel"), kernel.ensure_ops()
    for name in bench.SPLIT_SWEEP:
        with bench.splitk_modes(name) as backend:
            for n, k in QWEN3_8B.values():
                qw = quantize_blockwise(
                    _unread(n, k), (128, 128), pow2_scales=False, check_finite=False
                )
                scale = gemm_layouts.gemm_ready_weight_scales(backend, qw.scale_inv)
                for m in (1, 8, 32, 64):
                    kernel.serving_forward(ops, _unread(m, k), qw.data, scale, backend,
                                           torch.bfloat16, (False, False, 0.0))  # fmt: skip


def training_quantizers() -> None:
    """What `Fp8BlockLinear` launches besides its cuBLAS GEMMs, at 8192 tokens of Qwen3-8B."""
    from nemo_jetrl.fp8 import rowcol_quantize, triton_kernels

    for pow2 in (True, False):
        kw = {"pow2_scales": pow2, "check_finite": False}
        for k in (4096, 12288):
            x = _unread(8192, k)
            triton_kernels.quantize_blockwise_triton(x, (1, 128), **kw)
            triton_kernels.quantize_blockwise_triton(x, (1, 128), scale_layout="mn_major", **kw)
            triton_kernels.quantize_blockwise_triton(x, (128, 1), transpose=True, **kw)
            rowcol_quantize.quantize_rowcol_triton(x, **kw)
            g = _unread(8192, k)
            triton_kernels.quantize_blockwise_triton(g, (1, 128), fmt="e5m2", **kw)
        for n, k in QWEN3_8B.values():
            triton_kernels.quantize_blockwise_triton(_unread(n, k), (128, 128), **kw)
        for m in (1, 8192):
            triton_kernels.rmsnorm_quantize_1x128(_unread(m, 4096), _unread(4096), **kw)


def training_linear() -> None:
    """`Fp8BlockLinear` forward and backward at 8192 tokens of Qwen3-8B on the ``triton`` GEMM
    backend (cuBLASLt, the default, is no Triton kernel), both rowcol modes."""
    from nemo_jetrl.fp8 import Fp8BlockLinear, Fp8LinearConfig
    from nemo_jetrl.fp8.gemm_backends import ENV_GEMM_BACKEND
    from nemo_jetrl.fp8.linear_plan import ENV_ROWCOL

    for rowcol in ("fused", "two_pass"):
        with _bench("_common").environ({ENV_GEMM_BACKEND: "triton", ENV_ROWCOL: rowcol}):
            for n, k in QWEN3_8B.values():
                layer = Fp8BlockLinear(k, n, bias=False, dtype=torch.bfloat16,
                                       config=Fp8LinearConfig(pow2_scales=True))  # fmt: skip
                x = torch.empty(8192, k, dtype=torch.bfloat16, requires_grad=True)
                layer(x).backward(torch.empty(8192, n, dtype=torch.bfloat16))


def _routed_experts(model: str, tokens: int) -> None:
    """One routed-experts forward of ``model``'s MoE layer (the bench's shape, from the arch
    catalog) at ``tokens`` tokens, as the rollout runs it: `routed_experts_inference`, combine."""
    from nemo_jetrl.fp8 import Fp8LinearConfig
    from nemo_jetrl.fp8.experts_layer import combine, routed_experts_inference, sort_routes
    from nemo_jetrl.fp8.grouped_tensors import GroupedQuantizedWeights

    def loaded(e: int, n: int, k: int) -> GroupedQuantizedWeights:  # as a refit stages them
        data = torch.empty(e, n, k, dtype=torch.float8_e4m3fn)  # never touched: no page resident
        return GroupedQuantizedWeights(data, torch.ones(e, n // 128, k // 128), "e4m3", True)

    shape = _bench("bench_moe_layer").moe_shape(model)
    e, h, i, top_k = shape.experts, shape.hidden, shape.inter, shape.top_k
    q13, q2 = loaded(e, 2 * i, h), loaded(e, h, i)
    ids = (torch.arange(tokens * top_k, dtype=torch.int32) % e).view(tokens, top_k)
    order, token, offsets = sort_routes(ids, e)
    x = _unread(tokens, h)
    cfg = Fp8LinearConfig(pow2_scales=True)
    y = routed_experts_inference(x, token, offsets, q13, q2, cfg, "census", check_finite=False)
    combine(y, token, torch.ones(tokens * top_k)[order], tokens, top_k, x.dtype)


def experts() -> None:
    """The rollout's routed experts, decode and prefill: every model and token count of the GPU
    call's MoE step (`bench_moe_layer.py`: its MODELS and TOKENS)."""
    bench = _bench("bench_moe_layer")
    for model in bench.MODELS:
        for tokens in bench.TOKENS:
            _routed_experts(model, tokens)


def experts_tiles() -> None:
    """The MoE tile sweep (`bench_moe_layer.py --tiles sweep`): each `SWEEP_TILES` shape forced
    (``JETRL_FP8_GROUPED_ROWS_TILE``) at the prefill models and counts."""
    from nemo_jetrl.fp8.grouped_tiles import ENV_ROWS_TILE

    bench = _bench("bench_moe_layer")
    for tile in bench.SWEEP_TILES:
        with _bench("_common").environ({ENV_ROWS_TILE: tile}):
            for model in bench.PREFILL_MODELS:
                for tokens in bench.PREFILL_TOKENS:
                    _routed_experts(model, tokens)


def experts_training() -> None:
    """The trainer's grouped FP8 linear (`grouped_fp8_linear`), forward and backward, at 2048
    tokens of Qwen3-30B-A3B."""
    from nemo_jetrl.fp8 import Fp8LinearConfig
    from nemo_jetrl.fp8.experts import grouped_fp8_linear

    shape = _bench("bench_moe_layer").moe_shape("Qwen/Qwen3-30B-A3B")
    e, h, i, top_k = shape.experts, shape.hidden, shape.inter, shape.top_k
    rows = 2048 * top_k
    offsets = torch.arange(e + 1, dtype=torch.int64) * (rows // e)
    cfg = Fp8LinearConfig(pow2_scales=True)
    for n, k in ((2 * i, h), (h, i)):
        w = torch.empty(e, n, k, dtype=torch.bfloat16, requires_grad=True)
        x = torch.empty(rows, k, dtype=torch.bfloat16, requires_grad=True)
        grouped_fp8_linear(x, w, offsets, cfg, "census").backward(torch.empty(rows, n).bfloat16())


def invariant_ops() -> None:
    """The batch-invariant ops as the local backend runs them on a GPU (`invariant.hf`: every
    RMSNorm, the lm_head, attention in transformers' [B, T, H, D] -> [B, H, T, D] views, the
    log-softmax of the logits) at the ~0.6B model's and the demo model's sizes: decode rows and
    prefills, key lengths on and off a multiple of 16 (Triton specializes ints by it)."""
    from nemo_jetrl.invariant.kernels import attention, matmul, rows

    for hidden, vocab, heads, d in ((1024, 151936, 16, 128), (256, 32, 4, 64)):  # 0.6B, demo
        for m in (1, 3, 64, 512):
            x = _unread(m, hidden)
            rows.rms_rstd(x, 1e-6)
            matmul.matmul(x, _unread(vocab, hidden))
            matmul.matmul(x.float(), _unread(vocab, hidden, dtype=torch.float32))  # dtype float32
            rows.logsumexp_parts(_unread(m, vocab, dtype=torch.float32))
        for dtype in (torch.bfloat16, torch.float32):
            for tq, tk in ((1, 300), (1, 320), (300, 300), (320, 320)):  # decode, prefill
                q = _unread(2, tq, heads, d, dtype=dtype).transpose(1, 2)
                kv = _unread(2, tk, heads, d, dtype=dtype).transpose(1, 2)
                mask = _unread(2, 1, tq, tk, dtype=torch.float32)
                attention.attention(q, kv, kv, mask, d**-0.5)
    for tq in (1, 300):  # head_dim 256 (bf16): the most shared memory the stage rule allows
        q, kv = _unread(2, 16, tq, 256), _unread(2, 16, 300, 256)
        attention.attention(q, kv, kv, _unread(2, 1, tq, 300, dtype=torch.float32), 256**-0.5)


def quantizer_tiles() -> None:
    """Every candidate tile the GPU call's quantizer step times (`bench_quantizer_bandwidth.py
    --sweep-tiles`), through that script's own sweep, so the packed cache holds them. Its timer
    is replaced by a constant (labelled: no kernel runs here; each candidate's launch, made by its
    bits check, is what the census records)."""
    bench = _bench("bench_quantizer_bandwidth")
    bench._common.cuda_time_ms = lambda fn, iters: 1.0
    bench.sweep_tiles(SimpleNamespace(iters=1), device="cpu")


WORKLOADS: dict[str, Callable[[], None]] = {
    "serving": serving, "serving_sweep": serving_sweep, "training_quantizers": training_quantizers,
    "training_linear": training_linear, "experts": experts, "experts_training": experts_training,
    "invariant_ops": invariant_ops, "quantizer_tiles": quantizer_tiles,
    "experts_tiles": experts_tiles,
}  # fmt: skip
