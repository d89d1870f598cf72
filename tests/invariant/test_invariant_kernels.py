"""The invariant Triton kernels for rows (RMSNorm, log-softmax) and matmul, and `ops`' dispatch.

Without a GPU the kernels run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1); with
one, the same tests run the compiled kernels (the realistic sizes are in
test_invariant_kernels_gpu.py). Each kernel: a row's bits at batch sizes 1, 3, 8, 17 and at
another position in the batch (`batch_variance`), and its error vs float64 within a stated bound.
A planted variant whose reduction order depends on the batch fails the same check.
"""

from __future__ import annotations

import pytest
import torch
from invariant_checks import batch_variance, same_bits

from nemo_jetrl.invariant import dispatch, ops
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
    # The planted bug: fewer lanes for small batches (a 'decode' tuning) changes the order.
    x = _rand(17, 1500, scale=3.0)
    planted = batch_variance(lambda t: rows.rms_rstd(t, 1e-6, block=64 if len(t) < 8 else 1024), x)
    assert planted == ["m=1", "m=3"]
    xl = _rand(17, 5000, scale=5.0)
    planted = batch_variance(
        lambda t: rows.logsumexp_parts(t, block=128 if len(t) < 8 else 1024)[1], xl
    )
    assert planted == ["m=1", "m=3"]


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


def test_a_k_step_chosen_from_the_batch_size_fails_the_invariance_check():
    # The planted bug: shorter K steps for small batches (each step's dot is added into the
    # accumulator as one partial sum, so the step width is part of the order).
    x, w = _rand(17, 128), _rand(40, 128, seed=1)
    planted = batch_variance(lambda t: km.matmul(t, w, block_k=32 if len(t) < 8 else 64), x)
    assert planted == ["m=1", "m=3"]


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
