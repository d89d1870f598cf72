"""The local backend's BF16 CPU linears (`backends.local.bf16_gemm`): float64 GEMMs of the BF16
values, rounded to float32 then BF16, against a float64 reference; a row's bits whatever the rows
beside it; swapped in on both sides of a real run, where no BF16 GEMM reaches torch any more."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_jetrl.backends.local import bf16_gemm
from nemo_jetrl.backends.local.bf16_gemm import Bf16CpuLinear, linear, swap_bf16_linears

# the ops a linear layer reaches torch as (attention's batched products, bmm, are not linears:
# HF's eager attention runs them in BF16 where `batch_invariant` is off)
_GEMMS = {"mm", "addmm", "linear", "_mkldnn_linear"}


class _Bf16Gemms(TorchDispatchMode):
    """Records every linear-layer GEMM torch runs with a BF16 operand."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _GEMMS and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args
        ):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _operands(seed: int, k: int = 384, n: int = 200):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    return x, w, b


def _bound(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, k: int) -> torch.Tensor:
    """One BF16 rounding of the result (half an ulp: 2**-9 relative, doubled for the float32
    rounding before it) plus float32 accumulation over ``k`` terms (k * 2**-24 times the sum of
    |terms|: the backward's, and a bound the forward's float64 sums meet too), of
    ``ref = a @ b``'s float64 value."""
    mags = a.abs().double() @ b.abs().double()
    return ref.abs() * 2.0**-8 + mags * (k * 2.0**-24)


@pytest.mark.parametrize("seed", [0, 1])
def test_forward_is_within_one_rounding_of_the_float64_product(seed):
    x, w, b = _operands(seed)
    out = linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 7, 200)
    ref = x.double() @ w.double().t() + b.double()
    bound = _bound(x.reshape(-1, 384), w.t(), ref.reshape(-1, 200), 384).reshape(ref.shape)
    assert ((out.double() - ref).abs() <= bound).all()
    # the control: torch's own BF16 GEMM meets the same bound
    assert ((nn.functional.linear(x, w, b).double() - ref).abs() <= bound).all()


def test_a_rows_bits_do_not_depend_on_the_rows_computed_with_it():
    """What a decode step (few rows) and the trainer's forward (many) need from a BF16-kept
    layer: the float64 sums round to the same float32 whatever kernel the row count picks."""
    x, w, b = _operands(5, k=512, n=256)
    rows = x.reshape(-1, 512).repeat(32, 1)[:448]  # 448 rows, as the demo's training forward
    rows = rows + torch.randn(rows.shape, generator=torch.Generator().manual_seed(6)).bfloat16()
    full, sums = linear(rows, w, b), bf16_gemm.float32_sums(rows, w, b)
    assert torch.equal(full.view(torch.int16), sums.to(torch.bfloat16).view(torch.int16))
    for m in (*range(1, 40), 64, 100, 128, 200, 300):
        # before the BF16 rounding, which would hide most differences
        assert torch.equal(bf16_gemm.float32_sums(rows[:m], w, b), sums[:m]), m
        assert torch.equal(linear(rows[:m], w, b).view(torch.int16), full[:m].view(torch.int16)), m


def test_the_sums_are_float64_ones_rounded_once_to_float32():
    """Each product (1 + 2**-7)**2 * 2**-140 carries a 2**-154 that float32 (subnormal step
    2**-149 there) rounds away in any order; 32 of them in float64 keep 2**-149, one float32
    step, which the single rounding to float32 keeps."""
    v = (1 + 2**-7) * 2.0**-70
    x = torch.full((1, 32), v).bfloat16()
    assert x[0, 0].item() == v
    sums = bf16_gemm.float32_sums(x, x, None)
    assert sums.item() == torch.tensor(32 * v * v, dtype=torch.float64).float().item()
    assert sums.item() != (x.float() @ x.float().t()).item()  # the float32 GEMM's


def test_sums_are_accumulated_wider_than_bf16():
    """1 + 255 * 2**-9 = 1.498...; summed in BF16 every 2**-9 (a quarter ulp of 1) is lost and the
    result is 1.0; summed in float32 and rounded once it is 1.5."""
    x = torch.full((1, 256), 2.0**-9).bfloat16()
    x[0, 0] = 1.0
    w = torch.ones(1, 256).bfloat16()
    assert linear(x, w).item() == 1.5


def test_backward_gives_each_gradient_in_its_dtype_within_the_float64_bound():
    x, w, b = _operands(2)
    x, w, b = (t.clone().requires_grad_(True) for t in (x, w, b))
    g = torch.randn(2, 7, 200, generator=torch.Generator().manual_seed(3)).bfloat16()
    linear(x, w, b).backward(g)
    g2, x2 = g.reshape(-1, 200).double(), x.detach().reshape(-1, 384).double()
    dx_ref = g2 @ w.detach().double()
    dw_ref = g2.t() @ x2
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.bfloat16
    dx_bound = _bound(g.reshape(-1, 200), w.detach(), dx_ref, 200)
    dw_bound = _bound(g.reshape(-1, 200).t(), x.detach().reshape(-1, 384), dw_ref, 14)
    assert ((x.grad.reshape(-1, 384).double() - dx_ref).abs() <= dx_bound).all()
    assert ((w.grad.double() - dw_ref).abs() <= dw_bound).all()
    db_ref = g2.sum(0)
    assert (
        (b.grad.double() - db_ref).abs()
        <= _bound(torch.ones(1, 14), g.reshape(-1, 200), db_ref, 14)
    ).all()


def test_no_bf16_gemm_reaches_torch_and_other_dtypes_are_left_to_it():
    x, w, b = _operands(4)
    x.requires_grad_(True)
    with _Bf16Gemms() as rec:
        linear(x, w, b).sum().backward()
    assert rec.seen == []
    with _Bf16Gemms() as control:  # the recorder sees torch's own BF16 linear
        nn.functional.linear(x, w, b)
    assert control.seen
    xf, wf = x.detach().float(), w.float()
    assert torch.equal(linear(xf, wf), nn.functional.linear(xf, wf))
    assert not bf16_gemm.runs_here(xf, wf)


def test_swap_keeps_parameters_and_names_and_skips_other_linears():
    model = nn.Sequential(nn.Linear(16, 8).bfloat16(), nn.ReLU(), nn.Linear(8, 4))  # 2nd: fp32
    keys = list(model.state_dict())
    w0 = model[0].weight
    assert swap_bf16_linears(model) == ["0"]
    assert isinstance(model[0], Bf16CpuLinear) and model[0].weight is w0
    assert type(model[2]) is nn.Linear and list(model.state_dict()) == keys
    assert swap_bf16_linears(model) == []  # idempotent


@pytest.mark.parametrize(
    ("recipe", "extra", "swapped"),
    [
        ("bf16", (), 14),  # 2 layers x 7 decoder linears; lm_head batch-invariant
        ("jetrl", (), 0),  # every decoder linear FP8
        ("bf16", ("jetrl.local.batch_invariant=false",), 15),  # lm_head too
    ],
)
def test_a_run_swaps_its_bf16_linears_on_both_sides_and_runs_no_bf16_linear_gemm(
    tmp_path, recipe, extra, swapped
):
    pytest.importorskip("transformers")
    from local_configs import tiny_cfg

    from nemo_jetrl.backends.local.loop import Hooks, LocalRun, resolve_run

    run = LocalRun(resolve_run(tiny_cfg(recipe, tmp_path, tmp_path / "cache", *extra)))
    try:
        for model in (run.trainer.model, run.rollout_model):
            names = [n for n, m in model.named_modules() if isinstance(m, Bf16CpuLinear)]
            assert len(names) == swapped, names
            assert not any(type(m) is nn.Linear for m in model.modules())
        with _Bf16Gemms() as rec:
            run.train_step(Hooks())
        assert rec.seen == []
    finally:
        run.close()


def test_on_cuda_a_batch_invariant_run_multiplies_its_bf16_linears_invariantly(
    tmp_path, monkeypatch
):
    """On CUDA torch's BF16 GEMM (cuBLAS) picks its kernel, split-K included, by the row count:
    a BF16-kept decoder linear and a BF16 expert would sum a decode step's rows in another order
    than the trainer's forward. There a batch-invariant run puts them on the invariant matmul,
    both sides. FAKE of the device (no CUDA here): `needs_invariant_gemm` answers as on CUDA, so
    the CPU run takes the CUDA wiring (the invariant linear's torch form, exact on CPU too)."""
    pytest.importorskip("transformers")
    from local_configs import tiny_cfg

    from nemo_jetrl.backends.local.loop import Hooks, LocalRun, resolve_run
    from nemo_jetrl.invariant.hf import InvariantLinear

    assert bf16_gemm.needs_invariant_gemm(torch.device("cuda:1"))
    assert not bf16_gemm.needs_invariant_gemm(torch.device("cpu"))
    layer0 = ("+jetrl.train_bf16_layer_kws=[layers.0.]",
              "+policy.generation.vllm_cfg.quantization_ignored_layer_kws=[layers.0.]")  # fmt: skip
    monkeypatch.setattr(bf16_gemm, "needs_invariant_gemm", lambda device: True)
    run = LocalRun(resolve_run(tiny_cfg("jetrl", tmp_path, tmp_path / "cache", *layer0)))
    try:
        for model in (run.trainer.model, run.rollout_model):
            inv = [n for n, m in model.named_modules() if isinstance(m, InvariantLinear)]
            assert len(inv) == 8 and "model.layers.0.mlp.down_proj" in inv, inv  # 7 + lm_head
            assert not any(isinstance(m, Bf16CpuLinear) for m in model.modules())
        s, _ = run.train_step(Hooks())
        assert s["train/token_mult_prob_error"] == 1.0 and s["train/gen_kl_error"] == 0.0
    finally:
        run.close()


def test_on_cuda_invariant_bf16_experts_take_the_invariant_matmul(monkeypatch):
    """The BF16 experts of a batch-invariant MoE block: one GEMM per expert, on as many rows as
    the batch routes to it, so on CUDA each goes through the invariant matmul (FAKE device as
    above; the invariant linear's rows equal the rows computed alone)."""
    from nemo_jetrl.backends.local import moe_experts
    from nemo_jetrl.invariant import ops

    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 128, generator=g).bfloat16()
    w = (torch.randn(2, 64, 128, generator=g) / 12).bfloat16()
    offsets = torch.tensor([0, 4, 9])
    calls: list[int] = []
    real = ops.linear
    monkeypatch.setattr(
        ops, "linear", lambda a, b, c=None: calls.append(a.shape[0]) or real(a, b, c)
    )
    plain = moe_experts._bf16_grouped(x, w, offsets, invariant=True)  # CPU: the float64 path
    assert calls == []
    monkeypatch.setattr(bf16_gemm, "needs_invariant_gemm", lambda device: True)
    out = moe_experts._bf16_grouped(x, w, offsets, invariant=True)
    assert calls == [4, 5]
    assert torch.equal(out[4:5], real(x[4:5], w[1]))  # a row alone: the same bits
    assert moe_experts._bf16_grouped(x, w, offsets, invariant=False).equal(plain)
