"""Does the FP8 linear pay? Forward + backward time of one linear layer, FP8 blockwise vs BF16.

Shapes are the seven linears of one decoder layer of Llama-3.1-8B and Qwen3-8B(-Base) (q/k/v
fused as vLLM and Megatron run them, gate/up fused), at ``--tokens`` tokens per micro-batch.

* BF16: ``y = x W^T`` forward, ``dx = dy W`` and ``dW = dy^T x`` backward (cuBLAS).
* FP8 (ours): the TE ``Float8BlockScaling`` dataflow built from this package's pieces, each on
  its fast path: Triton quantizers (x and dy 1x128, W 128x128, x and dy 128x1 written
  transposed for WGrad) and `nemo_jetrl.fp8.dispatch.fp8_gemm` (DeepGEMM or cuBLASLt
  ``scaled_mm``). Quantization time is included; ``quant_share`` is its fraction.
* TE FP8 (if transformer_engine imports): ``te.Linear`` under ``fp8_autocast`` with
  ``Float8BlockScaling``, the training-side reference.
* Serving (the vLLM kernel's forward at ``--serve-tokens`` tokens): unchecked 1x128 quantization
  (no host sync) + the GEMM backend planned for the layer, and the Triton GEMM for comparison.

Usage: python benchmarks/gpu/bench_fp8_linear.py [--tokens 8192] [--iters 20]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import _common
import torch

MODELS = ("meta-llama/Llama-3.1-8B", "Qwen/Qwen3-8B-Base")


def layer_shapes(model: str) -> list[tuple[str, int, int]]:
    """(name, N = out_features, K = in_features) of one decoder layer, qkv and gate/up fused."""
    from nemo_jetrl.arch import builtin_arch

    arch = builtin_arch(model)
    if arch is None:
        raise SystemExit(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    lin = {x.kind: x for x in arch.layer_linears(0)}
    qkv = lin["q_proj"].out_features + lin["k_proj"].out_features + lin["v_proj"].out_features
    return [
        ("qkv_proj", qkv, arch.hidden_size),
        ("o_proj", arch.hidden_size, lin["o_proj"].in_features),
        ("gate_up_proj", 2 * arch.intermediate_size, arch.hidden_size),
        ("down_proj", arch.hidden_size, arch.intermediate_size),
    ]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (M)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--pow2", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--serve-tokens", type=int, default=256, help="M of the serving forward")
    return ap


def serve_fn(x, w, pow2: bool, backend: str):
    """The vLLM kernel's forward: unchecked 1x128 quantization + ``run_gemm(backend)``."""
    from nemo_jetrl.fp8 import quantize_blockwise
    from nemo_jetrl.fp8.gemm_backends import run_gemm

    qw = quantize_blockwise(w, (128, 128), pow2_scales=pow2)

    def run():
        qx = quantize_blockwise(x, (1, 128), pow2_scales=pow2, check_finite=False)
        return run_gemm(backend, qx, qw, torch.bfloat16)

    return run


def fp8_fwd_bwd(x, w, dy, pow2: bool, timings: dict | None = None) -> tuple:
    """One FP8 forward + backward of ``y = x @ w.T``; returns (y, dx, dw)."""
    from nemo_jetrl.fp8.dispatch import fp8_gemm
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton as qt

    kw = {"pow2_scales": pow2, "check_finite": False}
    qx = qt(x, (1, 128), **kw)
    qw = qt(w, (128, 128), **kw)
    qxc = qt(x, (128, 1), transpose=True, **kw)  # saved for WGrad: [K, M], 1x128 along tokens
    y = fp8_gemm(qx, qw)
    qdy = qt(dy, (1, 128), **kw)
    qwt = type(qw)(qw.data.t().contiguous(), qw.scale_inv.t().contiguous(), qw.block, qw.fmt, pow2)
    dx = fp8_gemm(qdy, qwt)
    qdyc = qt(dy, (128, 1), transpose=True, **kw)  # [N, M]
    dw = fp8_gemm(qdyc, qxc)
    return y, dx, dw


def fp8_quant_only(x, w, dy, pow2: bool) -> None:
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton as qt

    kw = {"pow2_scales": pow2, "check_finite": False}
    qt(x, (1, 128), **kw)
    qw = qt(w, (128, 128), **kw)
    qt(x, (128, 1), transpose=True, **kw)
    qt(dy, (1, 128), **kw)
    qw.data.t().contiguous()
    qt(dy, (128, 1), transpose=True, **kw)


def bf16_fwd_bwd(x, w, dy) -> tuple:
    y = x @ w.t()
    dx = dy @ w
    dw = dy.t() @ x
    return y, dx, dw


def te_fwd_bwd_fn(k: int, n: int, x: torch.Tensor, dy: torch.Tensor):
    """A closure running TE's blockwise-FP8 Linear fwd+bwd, or None without TE."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import Float8BlockScaling
    except Exception:
        return None
    layer = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    recipe = Float8BlockScaling()
    xr = x.detach().clone().requires_grad_(True)

    def run():
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = layer(xr)
        y.backward(dy)

    return run


def run(args: argparse.Namespace) -> list[dict]:
    from nemo_jetrl.fp8.dispatch import gemm_backend
    from nemo_jetrl.fp8.gemm_backends import plan_gemm
    from nemo_jetrl.fp8.triton_kernels import quantize_blockwise_triton as qt

    rows = []
    m = args.tokens
    for model in args.models:
        for name, n, k in layer_shapes(model):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            bf16 = _common.cuda_time_ms(partial(bf16_fwd_bwd, x, w, dy), iters=args.iters)
            fp8 = _common.cuda_time_ms(partial(fp8_fwd_bwd, x, w, dy, args.pow2), iters=args.iters)
            quant = _common.cuda_time_ms(
                partial(fp8_quant_only, x, w, dy, args.pow2), iters=args.iters
            )
            te_fn = te_fwd_bwd_fn(k, n, x, dy)
            te_ms = _common.cuda_time_ms(te_fn, iters=args.iters) if te_fn else None
            qx, qw = qt(x[:128], (1, 128)), qt(w, (128, 128))
            qa = qt(dy[:128], (128, 1), transpose=True)
            planned = plan_gemm(x.device, out_dtype=torch.bfloat16, pow2_scales=args.pow2)
            xs = x[: args.serve_tokens]
            serve = {
                be: _common.cuda_time_ms(serve_fn(xs, w, args.pow2, be), iters=args.iters)
                for be in {planned.backend, "triton"}
            }
            rows.append(
                {
                    "model": model.split("/")[-1],
                    "layer": name,
                    "M": m,
                    "N": n,
                    "K": k,
                    "bf16_ms": bf16,
                    "fp8_ms": fp8,
                    "speedup": bf16 / fp8,
                    "quant_share": quant / fp8,
                    "te_fp8_ms": te_ms if te_ms is not None else "n/a",
                    "te_speedup": bf16 / te_ms if te_ms else "n/a",
                    "gemm": f"{gemm_backend(qx, qw)}/{gemm_backend(qa, qa)}",
                    "serve_backend": planned.backend,
                    "serve_ms": serve[planned.backend],
                    "serve_triton_ms": serve["triton"],
                }
            )
    return rows


COLUMNS = (
    "model",
    "layer",
    "M",
    "N",
    "K",
    "bf16_ms",
    "fp8_ms",
    "speedup",
    "quant_share",
    "te_fp8_ms",
    "te_speedup",
    "gemm",
    "serve_backend",
    "serve_ms",
    "serve_triton_ms",
)


def check_agreement(args: argparse.Namespace) -> float:
    """Relative Frobenius error of the FP8 fwd/bwd outputs vs BF16 on the first shape."""
    _name, n, k = layer_shapes(args.models[0])[0]
    m = min(args.tokens, 1024)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    errs = []
    for a, b in zip(fp8_fwd_bwd(x, w, dy, args.pow2), bf16_fwd_bwd(x, w, dy), strict=True):
        errs.append(float((a.float() - b.float()).norm() / b.float().norm()))
    return max(errs)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _common.require_cuda("bench_fp8_linear")
    print(f"# {_common.gpu_name()}; FP8 scales {'pow2' if args.pow2 else 'fp32'}")
    print(f"# sanity: max relative error FP8 vs BF16 (y, dx, dw) = {check_agreement(args):.4f}")
    _common.print_table(run(args), COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
