"""The routed-experts layer of a serving engine on trainer-quantized weights: gate/up, SiLU*up,
down and the weighted combine, in the fewest passes that keep the training forward's bits.

`routed_experts_inference` takes the unsorted ``[T, H]`` input and the routed rows sorted by
expert (``token [R]``: the token of each row, ``offsets [E+1]``):

1. the input is quantized 1x128 **once**, ``[T, H]`` (not ``[T*k, H]``): a 1x128 block is one
   token's 128 values, so its codes and scale are those of quantizing the gathered copy bit for
   bit; the gate/up GEMM reads each row's codes and scale through ``token`` (`gemm_rows`'s
   ``rows``: the Triton kernel indexes A by row, the reference gathers FP8 rows), so there is
   neither a BF16 gather nor a ``top_k``-times larger quantization;
2. ``silu_mul_quantize``: SiLU(gate) * up by `silu_mul`'s rule (SiLU in fp32 rounded to the model
   dtype, the product in fp32 rounded once to the model dtype) fused with the down projection's
   1x128 quantization: one pass over gate_up instead of SiLU, mul and quantize passes;
3. the down GEMM on those codes, output in the model dtype.

`combine` sums each token's expert outputs weighted by its router weights in a fixed order, the
token's experts in ascending expert id, in fp32 (a ``[T, k]`` table of each token's sorted rows,
built from int ops; then one pass that reads the rows through it): no fp32 atomics (``index_add_``
on CUDA adds in whatever order the threads arrive), no permuted copy of the rows, and a token's
sum depends on its own rows only, never on the batch.

The training forward that gives the same bits: `experts.grouped_fp8_linear` on the gathered
input, `silu_mul.silu_mul`, `grouped_fp8_linear` again (its 1x128 quantization of the rounded
product is step 2's), and the same combine. The backend (``JETRL_FP8_GROUPED_BACKEND``) is
`experts.grouped_backend`'s: Triton on CUDA, the per-expert reference on CPU.
"""

from __future__ import annotations

import torch

from nemo_jetrl.fp8 import finite_flags
from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.experts import _check_inputs, _ops
from nemo_jetrl.fp8.grouped_tensors import GroupedQuantizedWeights
from nemo_jetrl.fp8.linear import check_expert_dims


def sort_by_expert(topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(by_expert, order, token)`` for ``topk_ids [T, k]``: the flattened expert ids sorted
    (stable: token order inside an expert), the sort's permutation, and each sorted row's token
    (its flat index // k: no token table built and gathered). Device ops only."""
    by_expert, order = torch.sort(topk_ids.reshape(-1).long(), stable=True)
    return by_expert, order, order // topk_ids.shape[1]


def sort_routes(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, token, offsets)`` for ``topk_ids [T, k]`` (`sort_by_expert`), with int64
    ``offsets [E+1]`` of each expert's rows. Device ops only (no host read)."""
    by_expert, order, token = sort_by_expert(topk_ids)
    grid = torch.arange(num_experts + 1, device=by_expert.device)
    return order, token, torch.searchsorted(by_expert, grid)


def _check_weights(q: GroupedQuantizedWeights, config: Fp8LinearConfig, name: str) -> None:
    if q.fmt != config.forward_format.name or q.pow2_scales != config.pow2_scales:
        raise ValueError(
            f"{name}: weights quantized as {q.fmt}/pow2={q.pow2_scales}, config wants "
            f"{config.forward_format.name}/pow2={config.pow2_scales}"
        )


def routed_experts_inference(
    x: torch.Tensor,
    token: torch.Tensor,
    offsets: torch.Tensor,
    w13: GroupedQuantizedWeights,
    w2: GroupedQuantizedWeights,
    config: Fp8LinearConfig,
    name: str,
    *,
    check_finite: bool = True,
) -> torch.Tensor:
    """Routed rows through their experts: ``[R, H]`` in ``x.dtype``, row r = token ``token[r]``
    through gate/up ``w13 [E, 2I, H]`` (gate rows first), `silu_mul`, down ``w2 [E, H, I]``.

    ``check_finite=False`` (a serving engine: warm-up runs on uninitialised buffers) lets
    non-finite values through; otherwise a non-finite input raises naming ``{name}.input``
    (CPU; on CUDA a device flag, `finite_flags.check_non_finite`)."""
    n_exp, two_i, h = w13.data.shape
    if x.dim() != 2 or x.shape[1] != h or tuple(w2.data.shape) != (n_exp, h, two_i // 2):
        raise ValueError(
            f"{name}: x [T, {h}], w13 [E, 2I, H], w2 [E, H, I] expected, got x "
            f"{tuple(x.shape)}, w13 {tuple(w13.data.shape)}, w2 {tuple(w2.data.shape)}"
        )
    rows = x.new_empty(token.shape[0], h)  # shape only: offsets must cover the routed rows
    _check_inputs(rows, two_i, h, n_exp, offsets, f"{name}.w13")
    check_expert_dims(two_i // 2, h, f"{name}.w2")
    for q, part in ((w13, "w13"), (w2, "w2")):
        _check_weights(q, config, f"{name}.{part}")
    ops = _ops(x)
    fmt, pow2, eps, exact = config.forward_format, config.pow2_scales, config.eps, config.exact_gemm
    deferred = check_finite and finite_flags.sync_free(x)
    kw = {
        "fmt": fmt,
        "pow2_scales": pow2,
        "eps": eps,
        "check_finite": check_finite and not deferred,
    }
    qx = ops.quantize_input(x, name=name, **kw)
    if deferred:
        finite_flags.record(f"{name}.input", qx.scale_inv)
    gate_up = ops.gemm_rows(qx, w13, offsets, out_dtype=x.dtype, exact=exact, rows=token)
    qa = ops.silu_mul_quantize(gate_up, offsets, name=f"{name}.w2", **kw)
    if deferred:
        finite_flags.record(f"{name}.w2.input", qa.scale_inv)
    return ops.gemm_rows(qa, w2, offsets, out_dtype=x.dtype, exact=exact)


def combine(
    y: torch.Tensor,
    token: torch.Tensor,
    weight: torch.Tensor,
    num_tokens: int,
    top_k: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[T, H]`` in ``out_dtype``: for each token, ``sum_j weight_j * y_j`` over its routed rows
    (``y [R, H]`` sorted by expert, ``token [R]``, ``weight [R]``, at most ``top_k`` rows a
    token) in ascending expert id (the rows' order inside a token): fp32 products, ``k - 1``
    fp32 adds, one rounding. Deterministic and batch-invariant; no host read. Triton (one
    launch, `triton_grouped.combine`) or the reference, as `experts.grouped_backend` says."""
    by_token = torch.argsort(token, stable=True)  # inside a token: expert order (y is sorted)
    if token.shape[0] == num_tokens * top_k:
        # every token has its k rows (at most k each, T*k in all): grouped by token they are
        # the table itself, one op where the general case below takes eight (eager prefill
        # pays each op's host dispatch)
        return _ops(y).combine(y, weight, by_token.view(num_tokens, top_k), out_dtype)
    tok = token[by_token]
    first = torch.searchsorted(tok, torch.arange(num_tokens, device=tok.device))
    slot = torch.arange(tok.shape[0], device=tok.device) - first[tok]
    pos = torch.full((num_tokens, top_k), -1, dtype=torch.int64, device=y.device)
    pos[tok, slot] = by_token  # each (token, slot) once: no atomics
    return _ops(y).combine(y, weight, pos, out_dtype)
