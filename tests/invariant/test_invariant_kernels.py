"""The invariant Triton kernels for rows (RMSNorm, log-softmax) and matmul, and `ops`' dispatch.

Without a GPU the kernels run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1); with
one, the same tests run the compiled kernels (the realistic sizes are in
test_invariant_kernels_gpu.py). Each kernel: a row's bits at batch sizes 1, 3, 8, 17 and at
another position in the batch (`batch_variance`), and its error vs float64 within a stated bound.
A planted variant whose reduction order depends on the batch fails the same check, on a GPU as
under the interpreter: the planted checks assert that some row's bits move (which rows depends on
the arithmetic: FMA contraction and ex2/lg2.approx on a GPU, IEEE here), and the matmul's is a
split of K on bf16 operands (tensor cores), not a K-step width (one MMA chain per output on a GPU
whatever BK). The attention kernel's pipeline stages fit Hopper's shared memory at head_dim
64/128/256; they are part of the compiled kernel (other stages, other bits on an H200), so they
depend on the head dim and operand size alone and a decode step equals the prefill at them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from invariant_checks import batch_variance, same_bits

from nemo_jetrl.invariant import dispatch, ops
from nemo_jetrl.invariant.kernels import attention as ka
from nemo_jetrl.invariant.kernels import matmul as km
from nemo_jetrl.invariant.kernels import rows

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
U32 = 2.0**-24  # fp32 unit roundoff
# Compiled on a GPU: tl.exp/tl.log are ex2/lg2.approx (~2 ulp) and tensor cores may truncate
# inside their fp32 accumulation, so the bounds there are looser (the interpreter is IEEE).
ON_GPU = DEVICE == "cuda"


def _rand(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


# ------------------------------------------------------------------------------ rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_rstd_same_bits_at_every_batch_size_and_within_2ulp_of_float64(dtype):
    # H = 1500: one full 1024-lane chunk and a partial one.
    x = _rand(17, 1500, dtype=dtype, scale=3.0)
    assert batch_variance(lambda t: rows.rms_rstd(t, 1e-6), x) == []
    got = rows.rms_rstd(x, 1e-6).double().cpu()
    ref = rows.rms_rstd_reference(x, 1e-6).cpu()
    # fp32 sum of 1500 squares in 1024 lanes (<= 2 adds each) + a 10-level tree, then / sqrt /
    assert ((got - ref).abs() / ref).max() <= 16 * U32


def test_log_softmax_same_bits_at_every_batch_size_and_close_to_float64():
    # V = 5000: four full chunks and a partial one; logits spread like a model's (sd 5).
    x = _rand(17, 5000, scale=5.0)

    def lsm(t):
        mx, log_sum = rows.logsumexp_parts(t)
        return (t - mx) - log_sum

    assert batch_variance(lsm, x) == []
    ref = rows.log_softmax_reference(x).cpu()
    err = (lsm(x).double().cpu() - ref).abs()
    # the subtraction rounds at |ref| (<= 2 ulp), log(sum) adds a few ulp of ~log(V)
    bound = 4 * U32 * ref.abs() + (4e-6 if ON_GPU else 1e-6)
    assert (err <= bound).all(), float((err - bound).max())


def test_a_row_block_chosen_from_the_batch_size_fails_the_invariance_check():
    # The planted bug: fewer lanes for batches under 17 rows (a 'decode' tuning) changes the
    # order of m=1, 3 and 8 (12 rows). Some row's bits must move; which ones depends on the
    # arithmetic, so the test names none. The full batch, reversed, takes the shipped lanes.
    x = _rand(17, 1500, scale=3.0)
    planted = batch_variance(lambda t: rows.rms_rstd(t, 1e-6, block=64 if len(t) < 17 else 1024), x)
    assert planted and "reversed" not in planted, planted
    xl = _rand(17, 5000, scale=5.0)
    planted = batch_variance(
        lambda t: rows.logsumexp_parts(t, block=128 if len(t) < 17 else 1024)[1], xl
    )
    assert planted and "reversed" not in planted, planted


# ------------------------------------------------------------------------------ matmul


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmul_same_bits_at_every_batch_size_and_within_gamma_k_of_float64(dtype):
    # K = 72: a full 64-wide K step and a partial one; N = 70: two column tiles.
    x, w = _rand(17, 72, dtype=dtype), _rand(70, 72, dtype=dtype, seed=1)
    assert batch_variance(lambda t: km.matmul(t, w), x) == []
    got, ref = km.matmul(x, w).double().cpu(), km.matmul_reference(x, w).cpu()
    # fp32 products (exact for bf16) summed in fp32: |err| <= (K + 1) u sum |x w|
    bound = (
        (2 if ON_GPU else 1)
        * (72 + 1)
        * U32
        * (x.double().abs().cpu() @ w.double().abs().cpu().t())
    )
    assert ((got - ref).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_k_split_chosen_from_the_batch_size_fails_the_invariance_check(dtype):
    # The planted bug: batches under 17 rows split K in two and add the halves (split-K, what
    # cuBLAS picks for small M). bf16 is the tensor-core path on a GPU, where a K step's width is
    # not part of the order (the MMAs chain through one accumulator whatever BK) but a split is;
    # fp32 there is one fma chain per output, which a split also cuts. Under the interpreter the
    # split at 40 (not a multiple of BK = 64) regroups the K steps' partial sums.
    x, w = _rand(17, 128, dtype=dtype), _rand(40, 128, dtype=dtype, seed=1)

    def split_k(t):
        if len(t) == len(x):
            return km.matmul(t, w)
        return km.matmul(t[:, :40], w[:, :40]) + km.matmul(t[:, 40:], w[:, 40:])

    planted = batch_variance(split_k, x)
    assert planted and "reversed" not in planted, planted


# ------------------------------------------------------------------------------ attention stages

# Shared memory a block may take on Hopper (sm_90), bytes: 227 KiB, Triton's "Hardware limit:
# 232448" on an H100 (benchmarks/gpu/results/h100_run1_landed/gpu_tests.log).
HOPPER_SMEM = 232_448
# (head_dim, operand bytes) -> pipeline stages: 2 where the tiles fit, 1 for fp32 at 256.
STAGES = {(64, 2): 2, (128, 2): 2, (256, 2): 2, (64, 4): 2, (128, 4): 2, (256, 4): 1}
NEG = torch.finfo(torch.bfloat16).min


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_stages_fit_hoppers_shared_memory_and_decode_equals_prefill_at_them(
    dtype, head_dim
):
    """The stage count is part of the compiled kernel: on an H200 (runs 7 and 8) 1 and 2 stages
    give other bits, fp fusion off or on. So it is a function of the head dim and operand size
    alone (`attention_stages`), never of the batch, and a decode step runs the prefill's kernel."""
    size = dtype.itemsize
    stages = ka.attention_stages(head_dim, size)
    assert stages == STAGES[head_dim, size]
    assert ka.attention_smem_bytes(head_dim, size, stages) <= HOPPER_SMEM
    if stages < 2:  # what the rule is for: the 2 stages shipped before it would not fit
        assert ka.attention_smem_bytes(head_dim, size, 2) > HOPPER_SMEM
    q, k, v = (_rand(1, 2, 20, head_dim, dtype=dtype, seed=s) for s in range(3))
    mask = torch.full((20, 20), NEG, device=DEVICE).triu(1)
    full = ka.attention(q, k, v, mask, head_dim**-0.5)
    for t in (0, 7, 19):
        sl = slice(t, t + 1)
        step = ka.attention(q[:, :, sl], k[:, :, : t + 1], v[:, :, : t + 1], mask[sl, : t + 1], head_dim**-0.5)  # fmt: skip
        assert same_bits(step[:, :, 0], full[:, :, t]), (dtype, head_dim, t)


def test_attention_launches_with_the_rules_stages(monkeypatch):
    launched = []

    class Kernel:  # records the launch instead of running it
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((kw["num_stages"], kw["enable_fp_fusion"]))

    monkeypatch.setattr(ka, "_jit", lambda: SimpleNamespace(attention_kernel=Kernel()))
    bf16, fp32 = torch.bfloat16, torch.float32
    for q_dtype, kv_dtype, d in ((bf16, bf16, 256), (fp32, fp32, 256), (fp32, fp32, 128), (bf16, fp32, 256)):  # fmt: skip
        q, kv = torch.zeros(1, 1, 3, d, dtype=q_dtype), torch.zeros(1, 1, 3, d, dtype=kv_dtype)
        ka.attention(q, kv, kv, None, 1.0)
        ka.attention(q[:, :, -1:], kv, kv, None, 1.0)  # a decode step: the prefill's stages
    # mixed operands are widened to fp32 first; never fp fusion (where LLVM fuses a mul and an
    # add into an fma follows the loop's layout). The stages still change bits on an H200 (run 8,
    # without fusion): the rule's count is what both sides launch.
    assert launched == [(2, False)] * 2 + [(1, False)] * 2 + [(2, False)] * 2 + [(1, False)] * 2


# Compiles the attention kernel for sm_90 with Triton's own compiler (no GPU needed) at the rule's
# stages and prints the shared memory Triton allocates (the estimate must bound it) and its fmas.
# fp32 at head_dim 256 only, the rule's one-stage shape, which no GPU path launches: every other shape is
# in the sm_90 census, which holds each to the estimate (tests/test_sm90_census.py).
_SM90_COMPILE = """
import inspect, json, sys
from collections import Counter
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nemo_jetrl.fp8.triton_launch import NO_FMA, NO_FTZ
sys.path.insert(0, "scripts")
import sm90_ptx
from nemo_jetrl.invariant.kernels import _jit_attention as ja, attention as ka
CONST = ("HAS_MASK", "BM", "BN", "BD", "IEEE", "ORDERED")
d, size = 256, 4  # fp32 operands
sig = {p: "i32" for p in inspect.signature(ja.attention_kernel.fn).parameters}
sig.update({p: "constexpr" for p in CONST}, scale="fp32", mask_ptr="*fp32", o_ptr="*fp32")
sig.update(q_ptr="*fp32", k_ptr="*fp32", v_ptr="*fp32")
consts = dict(HAS_MASK=True, BM=ka.ATTN_BLOCK_M, BN=ka.ATTN_BLOCK_N, BD=ka._head_block(d),
              IEEE=True, ORDERED=False)
stages = ka.attention_stages(d, size)
kernel = triton.compile(
    ASTSource(fn=ja.attention_kernel, signature=sig, constexprs=consts),
    target=GPUTarget("cuda", 90, 32),
    options=dict(num_warps=ka.ATTN_WARPS, num_stages=stages, **NO_FTZ, **NO_FMA),
)
arith = Counter(sm90_ptx.ARITH.findall(kernel.asm["ptx"]))
facts = [arith["fma.rn.f32"], sm90_ptx.unrounded(arith)]
print(json.dumps([[d, size, stages, kernel.metadata.shared, *facts]]))
"""


@pytest.mark.slow
def test_the_shared_memory_triton_allocates_for_sm90_is_within_the_estimate():
    # 78 s on a 2-core EPYC without AVX-512 (its spills keep ptxas busy); cached afterwards
    from tests.sm90_compile import compile_report

    compiled = compile_report(_SM90_COMPILE)
    assert [(d, size) for d, size, *_ in compiled] == [(256, 4)]
    for d, size, stages, shared, fmas, unrounded in compiled:
        assert stages == STAGES[d, size]
        assert 0 < shared <= ka.attention_smem_bytes(d, size, stages) <= HOPPER_SMEM, (d, size)
        # launched as `attention` launches it (no fp fusion): the only fmas are the FMA dots'
        # (2 x 64 x 64 x 256 products over 128 threads), no add/sub/mul left free to fuse
        assert (fmas, unrounded) == (16384, 0), (fmas, unrounded)


def test_matmul_refuses_mismatched_operands_by_name():
    with pytest.raises(ValueError, match=r"linear: input \[\.\.\., 8\] and weight \[4, 6\]"):
        km.matmul(_rand(2, 8), _rand(4, 6))
    with pytest.raises(ValueError, match=r"linear weight: dtype torch\.int32"):
        km.matmul(_rand(2, 8), torch.zeros(4, 8, dtype=torch.int32, device=DEVICE))


# ------------------------------------------------------------------------------ ops dispatch


def test_ops_take_the_kernels_when_chosen_and_the_torch_path_otherwise():
    x, w = _rand(5, 300, dtype=torch.bfloat16), _rand(300, dtype=torch.bfloat16, seed=1)
    logits, head = _rand(5, 300, scale=4.0), _rand(64, 300, dtype=torch.bfloat16, seed=2)
    with dispatch.use_kernels("triton"):
        norm_k, lsm_k = ops.rms_norm(x, w, 1e-6), ops.log_softmax(logits)
        lin_k = ops.linear(x, head)
    assert same_bits(norm_k, w * (x.float() * rows.rms_rstd(x, 1e-6)).to(x.dtype))
    mx, log_sum = rows.logsumexp_parts(logits)
    assert same_bits(lsm_k, (logits - mx) - log_sum)
    assert same_bits(lin_k, km.matmul(x, head).to(x.dtype))
    with dispatch.use_kernels("torch"):
        norm_t, lsm_t, lin_t = (
            ops.rms_norm(x, w, 1e-6),
            ops.log_softmax(logits),
            ops.linear(x, head),
        )
    assert dispatch.kernels() == "auto"  # the with block restored it
    # the torch path is the elementwise one (tree_sum), not the kernels
    var = ops.tree_sum(x.float() ** 2, dim=-1, keepdim=True) / 300
    assert same_bits(norm_t, w * (x.float() * (1.0 / torch.sqrt(var + 1e-6))).to(x.dtype))
    assert same_bits(lin_t, ops._linear_fwd(x, head, None))
    assert not same_bits(lsm_t, lsm_k)
    if DEVICE == "cpu":  # auto keeps CPU tensors on the torch path
        assert same_bits(ops.log_softmax(logits), lsm_t) and same_bits(ops.linear(x, head), lin_t)


def test_kernel_paths_have_the_torch_paths_gradients():
    x = _rand(4, 96, scale=2.0).requires_grad_()
    w = _rand(96, seed=1).requires_grad_()
    head = _rand(24, 96, seed=2).requires_grad_()
    g = _rand(4, 24, seed=3)

    def loss():
        return (ops.log_softmax(ops.linear(ops.rms_norm(x, w, 1e-6), head)) * g).sum()

    with dispatch.use_kernels("triton"):
        grads_k = torch.autograd.grad(loss(), (x, w, head))
    with dispatch.use_kernels("torch"):
        grads_t = torch.autograd.grad(loss(), (x, w, head))
    for a, b in zip(grads_k, grads_t, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_kernel_choice_is_checked_and_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="set_kernels: 'cuda' is not one of"):
        dispatch.set_kernels("cuda")
    monkeypatch.setenv(dispatch.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="JETRL_INVARIANT_KERNELS: 'fast' is not one of"):
        ops.rms_norm(_rand(2, 8), _rand(8), 1e-6)
    monkeypatch.setenv(dispatch.KERNELS_ENV, "triton")
    with pytest.raises(ValueError, match="rms_norm: the invariant kernels take"):
        ops.rms_norm(_rand(2, 8, dtype=torch.float64), _rand(8, dtype=torch.float64), 1e-6)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(
            ValueError, match=r"log_softmax: .* on a cpu tensor need TRITON_INTERPRET"
        ):
            ops.log_softmax(_rand(2, 8))


def test_token_log_softmax_has_the_gathered_rows_bits_on_both_paths():
    logits = _rand(2, 5, 700, scale=4.0).requires_grad_()
    ids = torch.randint(0, 700, (2, 5), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = []
    for choice in ("triton", "torch"):
        with dispatch.use_kernels(choice):
            tok = ops.token_log_softmax(logits, ids)
            full = ops.log_softmax(logits).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            assert same_bits(tok, full), choice
            grads.append(torch.autograd.grad(tok.sum(), logits)[0])
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
