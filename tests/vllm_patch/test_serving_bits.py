"""A token's output row from our vLLM kernel does not depend on the batch it is served in, and
equals the trainer's forward (`fp8_linear_forward`) row for that token, in both scale modes.

CPU: the kernel class driven as vLLM drives it (vLLM's base classes stood in, see
`serving_inventory`), planned on each GPU backend a CPU can run or stand in for: ``triton`` (the
real Triton GEMM and quantizer, CPU interpreter) and ``scaled_mm``
(Triton quantizer; cuBLASLt stood in by `scaled_mm_standin`, which refuses what cuBLASLt refuses
and multiplies exactly the operands and scales it is handed: it proves the layouts and the
M padding, not cuBLASLt's arithmetic). GPU (``gpu`` mark): the backends planned on the device,
M = 1..64 and up to 8192.

Not claimed: the CPU ``reference`` GEMM (vLLM's CPU build; `gemm.blockwise_matmul` with
``exact=False``, one fp32 matmul of the dequantized operands) is not batch-invariant: the BLAS's
summation order depends on M (seen here: a small-magnitude token's row differs at M = 2 vs 40).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from serving_inventory import (
    StandInBase,
    StandInMM,
    plan_as,
    scaled_mm_standin,
    served_layer,
)

from nemo_jetrl.fp8 import gemm_backends, gemm_layouts, quantize_blockwise, triton_kernels
from nemo_jetrl.fp8.linear import fp8_linear_forward
from nemo_jetrl.vllm_patch import compat, kernel, serving_ops

N, K = 256, 384
CPU_M = (1, 2, 3, 4, 5, 7, 8, 37, 40)
TRITON = triton_kernels.can_run(torch.zeros(1, dtype=torch.bfloat16))


def _operands(seed: int, m: int, n: int = N, k: int = K, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).exp2() * 4
    x[1] *= 1e-3  # a token of tiny magnitude (its own scale)
    return w.to(device), x.bfloat16().to(device)


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32_scales"])
@pytest.mark.parametrize("backend", ["triton", "scaled_mm"])
def test_a_tokens_row_is_the_same_at_every_batch_size_and_equals_the_trainers(
    monkeypatch, backend, pow2
):
    if not TRITON:
        pytest.skip("needs triton (its interpreter on CPU)")
    calls: list = []
    monkeypatch.setattr(F, "scaled_mm", scaled_mm_standin(calls, compute=True))
    monkeypatch.setattr(compat, "kernel_base_classes", lambda: (StandInBase, StandInMM))
    plan_as(monkeypatch, kernel, backend)
    # CUDA tensors get the Triton quantizer (interpreter here)
    monkeypatch.setattr(
        serving_ops, "quantize_blockwise", partial(quantize_blockwise, backend="triton")
    )
    w, x = _operands(11 + pow2, max(CPU_M))
    kern, layer, qw = served_layer(w, pow2)

    # The trainer's forward over the whole batch (M = 40: a multiple of 4, so cuBLASLt's): on
    # CUDA a bias-free `fp8_linear_forward` is `run_gemm` on its planned backend, on which the
    # CPU stands in here.
    qx = quantize_blockwise(x, (1, 128), pow2_scales=pow2)
    want = gemm_backends.run_gemm(backend, qx, qw, torch.bfloat16)
    for m in CPU_M:
        got = kern.apply_weights(layer, x[:m])
        assert got.shape == (m, N)
        bad = [i for i in range(m) if not torch.equal(got[i], want[i])]
        assert not bad, f"{backend} M={m}: rows {bad} differ from the trainer's forward"
    if backend == "scaled_mm":  # every batch ran on (the stand-in for) cuBLASLt, M padded to
        # 4 rows (pow2: cuBLASLt refused M % 4 != 0 on an H100, `shape_problem`) or 32 (FP32
        # scales: measured on an H100, cuBLASLt gave a token's row other bits at M_pad = 4, 8, 16
        # than among 8192 tokens at K >= 12288, the same at 32 and up; h100_run5/run6 in
        # benchmarks/gpu/results/README.md). Literals: the padding must not follow the constant.
        rows = 4 if pow2 else 32
        assert len(calls) == 1 + len(CPU_M)
        assert [c[0][0] for c in calls[1:]] == [-(-m // rows) * rows for m in CPU_M]


def test_on_the_split_k_backend_the_layers_rows_equal_the_trainers_and_compile_once(monkeypatch):
    """``triton_splitk`` (one op per call: quantization inside the GEMM at M <= 16), driven as
    vLLM drives the layer, K = 1280 (two chunks: split mode up to 64 tokens): every row at every
    batch size equals the trainer's forward on the same backend, with no row padding in FP32-
    scale mode; the op's fake matches it, and one dynamic-shape compile serves every M."""
    if not TRITON:
        pytest.skip("needs triton (its interpreter on CPU)")
    monkeypatch.setattr(compat, "kernel_base_classes", lambda: (StandInBase, StandInMM))
    plan_as(monkeypatch, kernel, "triton_splitk")
    k = 1280
    w, x = _operands(13, max(CPU_M), k=k)
    kern, layer, qw = served_layer(w, False)
    qx = quantize_blockwise(x, (1, 128), pow2_scales=False)
    want = fp8_linear_forward(qx, qw, None, torch.bfloat16, backend="triton_splitk")
    for m in CPU_M:
        got = kern.apply_weights(layer, x[:m])
        bad = [i for i in range(m) if not torch.equal(got[i], want[i])]
        assert got.shape == (m, N) and not bad, f"M={m}: rows {bad} differ"

    ops = kernel.ensure_ops()
    args = (qw.data, qw.scale_inv, torch.bfloat16, False, False, 0.0)
    # the fake's shapes (schema checking compares inputs with mul, which FP8 tensors lack)
    op = ops.fp8_split_linear.default
    torch.library.opcheck(op, (x[:5].clone(), *args), test_utils=("test_faketensor",))

    def forward(x2):
        return kernel.serving_forward(
            ops, x2, qw.data, qw.scale_inv, "triton_splitk", torch.bfloat16, (False, False, 0.0)
        )

    torch._dynamo.reset()
    frames = []
    compiled = torch.compile(
        forward, backend=lambda gm, inputs: frames.append(gm) or gm.forward, dynamic=True,
        fullgraph=True,
    )  # fmt: skip
    for m in (37, 5, 3):
        assert torch.equal(compiled(x[:m]), want[:m]), m
    assert len(frames) == 1, f"{len(frames)} graphs compiled for 3 batch sizes"


def test_stored_weight_scales_are_a_view_that_in_place_writes_reach(monkeypatch):
    """Refit copies into ``weight_scale_inv`` in place and the parity read-back reads it: both
    must see the storage cuBLASLt reads (`gemm_ready_weight_scales`), and storing is idempotent
    (vLLM runs process_weights_after_loading again on every reload)."""
    g = torch.Generator().manual_seed(2)
    s = torch.rand(2, 3, generator=g) + 0.5  # K = 384: 3 scale columns, cuBLASLt wants 4
    ready = gemm_layouts.gemm_ready_weight_scales("scaled_mm", s)
    assert torch.equal(ready, s) and ready.stride() == (4, 1)
    assert gemm_layouts.gemm_ready_weight_scales("scaled_mm", ready) is ready
    p = torch.nn.Parameter(s.clone(), requires_grad=False)
    p.data = ready
    new = torch.rand(2, 3, generator=g)
    p.data.copy_(new)  # what vLLM's weight loader and the reload's copy-back do
    storage = ready.as_strided((2, 4), (4, 1))
    assert torch.equal(storage[:, :3], new) and torch.equal(storage[:, 3], torch.zeros(2))
    assert torch.equal(p.detach().contiguous(), new)  # the read-back's bytes
    assert gemm_layouts.gemm_ready_weight_scales("deep_gemm", s).is_contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32_scales"])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (6144, 4096), (4096, 12288)])
def test_gpu_a_tokens_row_is_the_same_at_every_batch_size_and_equals_the_trainers(pow2, n, k):
    """The GEMM the device plans (DeepGEMM, cuBLASLt or Triton): rows at M = 1..64 and up to
    8192 equal the trainer's forward over 8192 tokens on the same plan, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda", torch.cuda.current_device())
    backend = gemm_backends.plan_gemm(dev, out_dtype=torch.bfloat16, pow2_scales=pow2).backend
    w, x = _operands(5 + pow2, 8192, n, k, "cuda")
    qw = quantize_blockwise(w, (128, 128), pow2_scales=pow2)
    scale = gemm_layouts.gemm_ready_weight_scales(backend, qw.scale_inv.clone())
    qx = quantize_blockwise(x, (1, 128), pow2_scales=pow2)
    want = fp8_linear_forward(qx, qw, None, torch.bfloat16)  # the trainer's own plan
    ops = kernel.ensure_ops()
    for m in [*range(1, 65), 127, 129, 255, 256, 1000, 1023, 4095, 4096, 8191, 8192]:
        got = kernel.serving_forward(
            ops, x[:m], qw.data, scale, backend, torch.bfloat16, (pow2, pow2, 0.0)
        )
        differ = (got != want[:m]).any(dim=1).nonzero().flatten().tolist()
        assert not differ, f"{backend} M={m}: rows {differ[:8]} differ from the trainer's"


@pytest.mark.skipif(not TRITON, reason="needs triton (its interpreter on CPU)")
def test_padded_ops_compile_once_for_every_batch_size(monkeypatch):
    """vLLM compiles the model with a dynamic token dimension: the quantize op's fake must give
    the real op's padded shapes and strides (`torch.library.opcheck`, which also needs the padded
    rows deterministic: zero codes, scale 1, written by the quantizer's own launch), and M padded
    to 4 inside the ops must not specialize the graph (one compile serves M = 37, 5 and 64, same
    bits as eager)."""
    from nemo_jetrl.fp8 import fp8_bits

    calls: list = []
    monkeypatch.setattr(F, "scaled_mm", scaled_mm_standin(calls, compute=True))
    plan_as(monkeypatch, kernel, "scaled_mm")
    ops = kernel.ensure_ops()
    w, x = _operands(3, 64)
    qw = quantize_blockwise(w, (128, 128), pow2_scales=False)
    scale = gemm_layouts.gemm_ready_weight_scales("scaled_mm", qw.scale_inv.clone())
    x37 = x[:37].clone()
    torch.library.opcheck(ops.quantize_act_1x128.default, (x37, False, 0.0, True, 4))
    q, s = ops.quantize_act_1x128(x37, False, 0.0, True, 4)
    assert q.shape == (40, K) and s.shape == (40, 3) and s.stride() == (1, 40)
    ref = quantize_blockwise(x37, (1, 128), pow2_scales=False)
    assert torch.equal(fp8_bits(q[:37]), fp8_bits(ref.data)) and torch.equal(s[:37], ref.scale_inv)
    assert not fp8_bits(q[37:]).any() and torch.equal(s[37:], torch.ones(3, 3))

    def forward(x2):
        return kernel.serving_forward(
            ops, x2, qw.data, scale, "scaled_mm", torch.bfloat16, (False, False, 0.0)
        )

    torch._dynamo.reset()
    frames = []
    compiled = torch.compile(
        forward,
        backend=lambda gm, inputs: frames.append(gm) or gm.forward,
        dynamic=True,
        fullgraph=True,
    )
    for m in (37, 5, 64):
        assert torch.equal(compiled(x[:m]), forward(x[:m])), m
    assert len(frames) == 1, f"{len(frames)} graphs compiled for 3 batch sizes"
