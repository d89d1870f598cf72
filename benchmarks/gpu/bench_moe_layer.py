"""Is the on-policy FP8 MoE expert layer faster than BF16 in the rollout? One routed-experts layer
(gate_up, SiLU-mul, down, top-k combine) timed three ways in one run.

* ours: the serving layer `fp8.experts_layer` on the trainer-quantized expert weights
  (`quantize_expert_weights`, the bytes a refit loads): the tokens quantized 1x128 once and read
  per routed row by the grouped gate/up GEMM (no gathered copy), SiLU(gate) * up fused with the
  down projection's quantization (`fp8.silu_mul`'s rule), the grouped down GEMM, and the
  fixed-order fp32 combine (`experts_layer.combine`, no atomics); Triton on CUDA,
  ``JETRL_FP8_GROUPED_BACKEND`` picks.
* vllm_fp8: vLLM's own block-FP8 fused MoE, the functional entry point
  ``vllm.model_executor.layers.fused_moe.fused_experts`` with
  ``fp8_w8a8_moe_quant_config(block_shape=[128, 128])`` on the same FP8 bytes and scales (its
  own activation quantizer, its Triton kernel; a serving engine may pick DeepGEMM/CUTLASS).
* bf16: vLLM's ``fused_experts`` unquantized on the BF16 masters (``bf16_vllm``) and a torch
  grouped reference (``torch._grouped_mm``, else a per-expert loop: ``bf16_torch``).

A vLLM row that cannot run prints why and stays ``n/a``; nothing is substituted. Shapes: the
routed experts of Qwen3-30B-A3B (hidden 2048, 768 per expert, 128 experts, top-8),
Moonlight-16B-A3B and DeepSeek-V3 (`nemo_jetrl.arch`'s catalog), at 64, 256 (decode) and 2048,
8192 (prefill) tokens; softmax top-k of a random router. Up to ``--graph-max-tokens`` tokens
each method runs in a CUDA graph, above eager; times `_common.bench_ms` (median, L2 flushed).

Bars. Per Qwen3-30B-A3B row, MET when bf16 / ours >= 1.30 (FP8-RL report: W8A8 rollout 30-50%
faster than BF16; bf16 = vLLM's when it ran). Issue 35's target, its own line: ours >= 1.30x
``torch._grouped_mm`` BF16 at each of 64, 256, 2048, 8192 tokens; a count not run or a
per-expert-loop reference is NOT MET, named. Each row first checks ours == the training forward
(`grouped_fp8_linear`, `silu_mul`, same combine) bit for bit; a mismatch exits 1.

Issue 48's prefill target, its own line: ours >= 1.30x ``torch._grouped_mm`` BF16 at 2048 and
8192 tokens on Qwen3-30B-A3B and DeepSeek-V3, timed eager (vLLM runs prefill batches above its
CUDA-graph sizes eagerly). Each row names the grouped GEMM's program shape the default path
chose (``tile``, `fp8.grouped_tiles`); ``--tiles p64 g128 ...`` also times ours under those
shapes (``JETRL_FP8_GROUPED_ROWS_TILE``) at the prefill counts, each checked bit for bit
against the training forward (the bits must not depend on the shape), and names the fastest.

First GPU figures (the unfused layer): results/h100_run2; the fused layer: results/README.md
runs 4-6. The device-scheduled persistent grouped GEMM (issue 48) has not run on a GPU;
tests/test_bench_moe_layer_cpu.py runs its CPU parts. Usage:
python benchmarks/gpu/bench_moe_layer.py [--models ...] [--tokens 64 256 2048 8192]
    [--tiles p64 g128 d64 | --tiles sweep] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import _common
import _moe_report
import torch
from _moe_report import (  # noqa: F401 (the targets and record version: the tests read them here)
    BAR_MODEL,
    BAR_SPEEDUP,
    COLUMNS,
    PREFILL_MODELS,
    PREFILL_TOKENS,
    RECORD_VERSION,
    TARGET_TOKENS,
    MoeShape,
    bar_summary,
    forced_tile,
    make_row,
    prefill_summary,
    record,
    target_summary,
    tile_choice,
)

from nemo_jetrl.fp8.grouped_tiles import ROWS_TILES

MODELS = ("Qwen/Qwen3-30B-A3B", "moonshotai/Moonlight-16B-A3B", "deepseek-ai/DeepSeek-V3")
TOKENS = (64, 256, 2048, 8192)  # decode steps of 64/256 sequences; prefill chunks

SWEEP_TILES = ("d64", "p64", "p128", "g128", "p128t", "p64t")
"""The grouped GEMM shapes ``--tiles sweep`` times at the prefill counts (the GPU call's
``bench_moe_tiles`` step; the sm_90 census compiles them, so they come from the carried cache):
every `ROWS_TILES` shape but p64t3, whose 168-register cap spills 120-152 bytes on sm_90."""
ERR_SUSPECT = 0.25  # relative error vs BF16 above which an FP8 output means a wrong layout


def moe_shape(model: str) -> MoeShape:
    """The routed-experts shape of ``model`` from the package's architecture catalog."""
    from nemo_jetrl.arch import builtin_arch

    arch = builtin_arch(model)
    if arch is None or arch.moe is None:
        raise SystemExit(f"{model!r} is not a catalogued MoE model; try {', '.join(MODELS)}")
    moe = arch.moe
    return MoeShape(model, arch.hidden_size, moe.expert_size, moe.num_experts, moe.top_k)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--pow2", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--graph-max-tokens", type=int, default=512, help="CUDA graph up to here")
    ap.add_argument(
        "--tiles", nargs="*", default=[], choices=[*ROWS_TILES, "sweep"], metavar="SHAPE",
        help=f"also time ours under these grouped GEMM shapes at the prefill token counts "
        f"(fp8.grouped_tiles: {', '.join(ROWS_TILES)}; sweep: {' '.join(SWEEP_TILES)})",
    )  # fmt: skip
    ap.add_argument("--json", type=Path, default=None, help="write the result record here")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def chosen_tiles(tiles: list[str]) -> list[str]:
    """``--tiles`` with ``sweep`` standing for `SWEEP_TILES`: each shape once, in order."""
    named = [t for name in tiles for t in (SWEEP_TILES if name == "sweep" else (name,))]
    return list(dict.fromkeys(named))


def make_layer(shape: MoeShape, device: str, seed: int, pow2: bool) -> dict:
    """BF16 masters ``w13 [E, 2I, H]`` (gate rows first, vLLM's layout), ``w2 [E, H, I]``, a
    router, and the trainer-quantized FP8 copies ``q13``/``q2``."""
    from nemo_jetrl.fp8 import Fp8LinearConfig
    from nemo_jetrl.fp8.experts import quantize_expert_weights

    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.experts, shape.hidden, shape.inter
    kw = {"generator": g, "device": device, "dtype": torch.bfloat16}
    w13 = torch.randn(e, 2 * i, h, **kw).mul_(h**-0.5)
    w2 = torch.randn(e, h, i, **kw).mul_(i**-0.5)
    router = torch.randn(e, h, **kw).mul_(h**-0.5)
    cfg = Fp8LinearConfig(pow2_scales=pow2)
    q13 = quantize_expert_weights(w13, cfg, "bench.w13")
    q2 = quantize_expert_weights(w2, cfg, "bench.w2")
    return {"w13": w13, "w2": w2, "router": router, "q13": q13, "q2": q2, "cfg": cfg}


def route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32, expert ids int32) ``[T, k]``: softmax top-k, renormalized."""
    probs = torch.softmax((x @ router.t()).float(), dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    return w / w.sum(-1, keepdim=True), ids.to(torch.int32)


def sort_routes(ids: torch.Tensor, n_exp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token of each sorted row, inverse permutation, int64 offsets ``[E+1]``); no host read."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    offsets = torch.searchsorted(flat[order], torch.arange(n_exp + 1, device=ids.device))
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=ids.device))
    return order // ids.shape[1], inv, offsets


Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x sorted, offsets) -> y


def silu_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """BF16 references: torch's SiLU times up (what a BF16 engine runs)."""
    return torch.nn.functional.silu(gate) * up


def experts_layer(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, n_exp: int, lin13: Linear,
    lin2: Linear, act: Callable = silu_up,
) -> torch.Tensor:  # fmt: skip
    """Routed experts around two grouped linears (the BF16 references and the training
    forward); the combine sums each token's k rows in a fixed order (deterministic, unlike an
    atomic index_add)."""
    token, inv, offsets = sort_routes(ids, n_exp)
    gu = lin13(x.index_select(0, token), offsets)
    gate, up = gu.chunk(2, dim=-1)
    y = lin2(act(gate, up), offsets)
    y = y.index_select(0, inv).view(x.shape[0], ids.shape[1], -1)
    return (y.float() * weights[..., None]).sum(1).to(x.dtype)


def ours_fn(
    x: torch.Tensor, layer: dict, weights: torch.Tensor, ids: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """The rollout path: `experts_layer.routed_experts_inference` + `combine` (see above)."""
    from nemo_jetrl.fp8.experts_layer import combine, routed_experts_inference, sort_routes

    cfg, k = layer["cfg"], ids.shape[1]
    n_exp = layer["q13"].num_experts

    def run() -> torch.Tensor:
        order, token, offsets = sort_routes(ids, n_exp)
        y = routed_experts_inference(
            x, token, offsets, layer["q13"], layer["q2"], cfg, "bench", check_finite=False
        )
        return combine(y, token, weights.reshape(-1)[order], x.shape[0], k, x.dtype)

    return run


def train_forward(
    x: torch.Tensor, layer: dict, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The training forward on the BF16 masters (`grouped_fp8_linear`, `silu_mul`), same
    routing and combine as ours."""
    from nemo_jetrl.fp8.experts import grouped_fp8_linear as lin
    from nemo_jetrl.fp8.experts_layer import combine, sort_routes
    from nemo_jetrl.fp8.silu_mul import silu_mul

    cfg, n_exp = layer["cfg"], layer["w13"].shape[0]
    with torch.no_grad():
        order, token, offsets = sort_routes(ids, n_exp)
        gate, up = lin(x[token], layer["w13"], offsets, cfg, "bench.w13").chunk(2, dim=-1)
        y = lin(silu_mul(gate, up), layer["w2"], offsets, cfg, "bench.w2")
        w = weights.reshape(-1)[order]
        return combine(y, token, w, x.shape[0], ids.shape[1], x.dtype)


def _gmm(w: torch.Tensor) -> Linear:
    """``torch._grouped_mm`` over experts (offsets stay on the device)."""
    return lambda xs, off: torch._grouped_mm(xs, w.transpose(1, 2), offs=off[1:].int())


def _loop(w: torch.Tensor) -> Linear:
    """One matmul per expert (reads the offsets on the host: eager only)."""

    def run(xs: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        b = off.tolist()
        parts = [xs[b[e] : b[e + 1]] @ w[e].t() for e in range(w.shape[0])]
        return torch.cat(parts) if parts else xs.new_empty(0, w.shape[1])

    return run


LOOP = "per-expert loop"


def bf16_torch_fn(
    x: torch.Tensor, layer: dict, weights: torch.Tensor, ids: torch.Tensor
) -> tuple[Callable[[], torch.Tensor], str]:
    """BF16 reference: ``torch._grouped_mm`` where it runs, else a per-expert loop (the
    returned name says which, and why)."""
    w13, w2, n_exp = layer["w13"], layer["w2"], layer["w13"].shape[0]
    why = "torch has no _grouped_mm"
    if hasattr(torch, "_grouped_mm"):
        fn = partial(experts_layer, x, weights, ids, n_exp, _gmm(w13), _gmm(w2))
        try:
            fn()
            return fn, "torch._grouped_mm"
        except Exception as exc:  # e.g. a GPU generation it does not support
            why = f"torch._grouped_mm failed: {exc!r}"[:200]
    return partial(experts_layer, x, weights, ids, n_exp, _loop(w13), _loop(w2)), f"{LOOP} ({why})"


def vllm_fn(
    x: torch.Tensor, layer: dict, weights: torch.Tensor, ids: torch.Tensor, fp8: bool
) -> tuple[Callable | None, str]:
    """vLLM's ``fused_experts`` (block FP8 on our bytes, or BF16), or None and why not."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
    except Exception as exc:  # not installed, or the entry point moved
        return None, f"vLLM fused_experts not importable: {type(exc).__name__}: {exc}"
    if fp8:
        q13, q2 = layer["q13"], layer["q2"]
        qc = fp8_w8a8_moe_quant_config(
            w1_scale=q13.scale_inv, w2_scale=q2.scale_inv, block_shape=[128, 128]
        )
        w1, w2 = q13.data, q2.data
    else:
        qc, w1, w2 = None, layer["w13"], layer["w2"]

    def run() -> torch.Tensor:
        return fused_experts(x, w1, w2, weights, ids, quant_config=qc)

    try:
        run()
    except Exception as exc:
        return None, f"vLLM fused_experts ({'fp8' if fp8 else 'bf16'}) failed: {exc!r}"[:300]
    return run, "vllm fused_experts"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def rel_err(a: torch.Tensor | None, ref: torch.Tensor | None) -> float | None:
    if a is None or ref is None:
        return None
    return float((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def bitwise_check(
    x: torch.Tensor, layer: dict, weights: torch.Tensor, ids: torch.Tensor, tiles: tuple = ()
) -> dict:
    """Ours (rollout) vs the training forward on the same inputs: equal bytes or not; ours is
    also checked under each forced shape in ``tiles`` (``tile_bitwise_equal``)."""
    ours = ours_fn(x, layer, weights, ids)()
    train = train_forward(x, layer, weights, ids)
    diff = int((ours.view(torch.int16) != train.view(torch.int16)).sum())
    out = {"bitwise_equal": same_bits(ours, train), "differing": diff, "elements": ours.numel()}
    if tiles:
        forced = {t: forced_tile(ours_fn(x, layer, weights, ids), t)() for t in tiles}
        out["tile_bitwise_equal"] = {t: same_bits(y, train) for t, y in forced.items()}
    return out


def run_row(
    shape: MoeShape, layer: dict, tokens: int, args: argparse.Namespace, skipped: list[str]
) -> dict:
    dev = layer["w13"].device
    g = torch.Generator(device=dev).manual_seed(args.seed + tokens)
    x = torch.randn(tokens, shape.hidden, generator=g, device=dev, dtype=torch.bfloat16)
    weights, ids = route(x, layer["router"], shape.top_k)
    tiles = tuple(args.tiles) if tokens in _moe_report.PREFILL_TOKENS else ()  # its one home
    bitwise = bitwise_check(x, layer, weights, ids, tiles)
    graph = tokens <= args.graph_max_tokens
    fns: dict[str, Callable | None] = {"ours_ms": ours_fn(x, layer, weights, ids)}
    fns["bf16_torch_ms"], bf16_impl = bf16_torch_fn(x, layer, weights, ids)
    for key, fp8 in (("vllm_fp8_ms", True), ("bf16_vllm_ms", False)):
        fns[key], why = vllm_fn(x, layer, weights, ids, fp8)
        if fns[key] is None:
            skipped.append(f"{shape.model} {tokens} tokens {key}: {why}")
            print(f"# skip {key}: {why}", file=sys.stderr)
    outs = {k: f() if f else None for k, f in fns.items()}
    ref = outs["bf16_vllm_ms"] if outs["bf16_vllm_ms"] is not None else outs["bf16_torch_ms"]
    errs = {"err_ours": rel_err(outs["ours_ms"], ref)}
    errs["err_vllm_fp8"] = rel_err(outs["vllm_fp8_ms"], ref)
    times: dict[str, float | None] = {}
    for key, fn in fns.items():
        use_graph = graph and not (key == "bf16_torch_ms" and bf16_impl.startswith(LOOP))
        try:
            times[key] = _common.bench_ms(fn, iters=args.iters, graph=use_graph) if fn else None
        except Exception as exc:
            times[key] = None
            skipped.append(f"{shape.model} {tokens} tokens {key}: timing failed: {exc!r}"[:300])
    tile_ms: dict[str, float | None] = {}
    for t in tiles:  # ours under each forced shape (same graph/eager mode as the row)
        fn = forced_tile(fns["ours_ms"], t)
        try:
            tile_ms[t] = _common.bench_ms(fn, iters=args.iters, graph=graph)
        except Exception as exc:
            tile_ms[t] = None
            skipped.append(f"{shape.model} {tokens} tokens tile {t}: timing failed: {exc!r}"[:300])
    mode = "graph" if graph else "eager"
    row = make_row(shape, tokens, times, errs, bitwise, mode, bf16_impl, tile_choice(shape, tokens))
    if tiles:
        row["tile_ms"] = tile_ms
    return row


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.tiles = chosen_tiles(args.tiles)
    _common.require_cuda("bench_moe_layer")
    from nemo_jetrl.fp8 import finite_flags
    from nemo_jetrl.fp8.experts import grouped_backend

    device = _common.gpu_name()
    probe = torch.empty(1, 128, device="cuda", dtype=torch.bfloat16)
    print(f"# {device}; scales {'pow2' if args.pow2 else 'fp32'}; grouped backend "
          f"{grouped_backend(probe)}; first figures: results/README.md")  # fmt: skip
    rows: list[dict] = []
    skipped: list[str] = []
    for model in args.models:
        shape = moe_shape(model)
        layer = make_layer(shape, "cuda", args.seed, args.pow2)
        for tokens in args.tokens:
            rows.append(run_row(shape, layer, tokens, args, skipped))
            print(f"# done {model} {tokens} tokens", file=sys.stderr, flush=True)
        del layer
        torch.cuda.empty_cache()
    finite_flags.check_non_finite()  # raises naming an expert if any scale went non-finite
    display = [{k: ("n/a" if v is None else v) for k, v in r.items()} for r in rows]
    _common.print_table(display, COLUMNS)
    print(f"# {bar_summary(rows)}")
    print(f"# {target_summary(rows)}")
    print(f"# {prefill_summary(rows)}")
    for r in rows:
        for key in ("err_ours", "err_vllm_fp8"):
            if r[key] is not None and r[key] > ERR_SUSPECT:
                print(f"# WARNING: {r['model']} {r['tokens']} tokens {key} = {r[key]:.3f} vs "
                      "BF16: not the same layer (argument layout?); its time means nothing")  # fmt: skip
    for line in skipped:
        print(f"# skipped: {line}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record(rows, device, args, skipped), indent=1))
        print(f"# wrote {args.json}")
    bad = [r for r in rows if not r["bitwise_equal"]]
    bad += [r for r in rows if not all((r.get("tile_bitwise_equal") or {}).values())]
    if bad:
        print(f"# FAILED: ours != the training forward on {len(bad)} row(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
