"""The rows, bars and MET / NOT MET lines of `bench_moe_layer` (split out to keep it short).

A row is one (model, token count): the times of ours, vLLM's FP8 and BF16 ``fused_experts`` and
the torch BF16 reference, the speedups, the grouped GEMM shape ours ran (``tile``) and, with
``--tiles``, ours under each forced shape. `bar_summary` is the FP8-RL report's bar on
Qwen3-30B-A3B, `target_summary` issue 35's decode + prefill target, `prefill_summary` issue 48's
prefill target on Qwen3-30B-A3B and DeepSeek-V3, `record` the JSON the benchmark writes.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

BAR_MODEL = "Qwen/Qwen3-30B-A3B"
BAR_SPEEDUP = 1.30  # FP8-RL report: W8A8 rollout 30-50% faster than BF16 on Qwen3-30B-A3B
TARGET_TOKENS = (64, 256, 2048, 8192)  # issue 35: >= BAR_SPEEDUP x BF16 grouped at each
PREFILL_MODELS = ("Qwen/Qwen3-30B-A3B", "deepseek-ai/DeepSeek-V3")  # issue 48, point 3
PREFILL_TOKENS = (2048, 8192)
RECORD_VERSION = 2  # 2: tile, tile_ms, tile_bitwise_equal; the prefill target


@dataclass(frozen=True)
class MoeShape:
    model: str
    hidden: int
    inter: int  # one expert's MLP width I (gate_up is [2I, hidden])
    experts: int
    top_k: int


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def make_row(
    shape: MoeShape, tokens: int, times: dict[str, float | None], errs: dict[str, float | None],
    bitwise: dict, mode: str, bf16_impl: str, tile: str = "",
) -> dict:  # fmt: skip
    """One result record; ``speedup`` = bf16 / ours with bf16 = vLLM's BF16 when it ran."""
    bf16 = times.get("bf16_vllm_ms") or times.get("bf16_torch_ms")
    speedup = ratio(bf16, times.get("ours_ms"))
    bar = "-"  # the bar is Qwen3-30B-A3B's
    if shape.model == BAR_MODEL:
        bar = "n/a" if speedup is None else ("MET" if speedup >= BAR_SPEEDUP else "NOT MET")
    return {
        "model": shape.model.split("/")[-1], "tokens": tokens, "routed_rows": tokens * shape.top_k,
        "E": shape.experts, "top_k": shape.top_k, "H": shape.hidden, "I": shape.inter,
        "mode": mode, "tile": tile, **times, "bf16_torch_impl": bf16_impl,
        "speedup": speedup, "vllm_fp8_speedup": ratio(bf16, times.get("vllm_fp8_ms")),
        "ours_vs_vllm_fp8": ratio(times.get("vllm_fp8_ms"), times.get("ours_ms")), "bar": bar,
        **errs, **bitwise,
    }  # fmt: skip


def bar_summary(rows: list[dict]) -> str:
    """MET only when every Qwen3-30B-A3B row measured reaches the bar."""
    name = BAR_MODEL.split("/")[-1]
    mine = [r for r in rows if r["model"] == name]
    lead = f"bar (FP8-RL report, {name} W8A8 rollout >= {BAR_SPEEDUP:.2f}x BF16), layer level:"
    if not mine or any(r["bar"] == "n/a" for r in mine):
        return f"{lead} NOT MEASURED"
    short = [f"{r['tokens']} tokens {r['speedup']:.2f}x" for r in mine if r["bar"] != "MET"]
    return f"{lead} " + ("MET on every row" if not short else "NOT MET (" + ", ".join(short) + ")")


def target_summary(rows: list[dict]) -> str:
    """Issue 35's MoE target: MET only when every token count of `TARGET_TOKENS` was measured on
    Qwen3-30B-A3B against ``torch._grouped_mm`` BF16 and reached `BAR_SPEEDUP`."""
    name = BAR_MODEL.split("/")[-1]
    lead = (
        f"target (issue 35): {name} >= {BAR_SPEEDUP:.2f}x BF16 grouped (torch._grouped_mm) at "
        f"{', '.join(map(str, TARGET_TOKENS))} tokens:"
    )
    by_tokens = {r["tokens"]: r for r in rows if r["model"] == name}
    short = []
    for t in TARGET_TOKENS:
        r = by_tokens.get(t)
        if r is None:
            short.append(f"{t} not run")
        elif r.get("bf16_torch_impl") != "torch._grouped_mm":
            short.append(f"{t} BF16 reference is not torch._grouped_mm")
        else:
            sp = ratio(r.get("bf16_torch_ms"), r.get("ours_ms"))
            if sp is None or sp < BAR_SPEEDUP:
                short.append(f"{t} " + ("not timed" if sp is None else f"{sp:.2f}x"))
    return f"{lead} " + ("MET" if not short else f"NOT MET ({'; '.join(short)})")


def _vs_grouped_mm(r: dict) -> float | None:
    if r.get("bf16_torch_impl") != "torch._grouped_mm":
        return None
    return ratio(r.get("bf16_torch_ms"), r.get("ours_ms"))


def prefill_summary(rows: list[dict]) -> str:
    """Issue 48's MoE prefill target: MET only when each of `PREFILL_MODELS` at each of
    `PREFILL_TOKENS` was timed (eager) against ``torch._grouped_mm`` BF16 and ours (the
    default shape) reached `BAR_SPEEDUP`. The fastest forced shape is named beside a row."""
    lead = (
        f"target (issue 48, prefill, eager): {', '.join(m.split('/')[-1] for m in PREFILL_MODELS)}"
        f" >= {BAR_SPEEDUP:.2f}x BF16 grouped (torch._grouped_mm) at "
        f"{', '.join(map(str, PREFILL_TOKENS))} tokens:"
    )
    by_key = {(r["model"], r["tokens"]): r for r in rows}
    parts, short = [], False
    for model in PREFILL_MODELS:
        name = model.split("/")[-1]
        for t in PREFILL_TOKENS:
            r = by_key.get((name, t))
            sp = None if r is None else _vs_grouped_mm(r)
            short |= sp is None or sp < BAR_SPEEDUP
            text = "not run" if r is None else ("n/a" if sp is None else f"{sp:.2f}x")
            if r is not None and r.get("tile"):
                best = _best_tile(r)
                fastest = f"; fastest {best[0]} {best[1]:.2f}x" if best else ""
                text += f" [{r['tile'].split()[0]}{fastest}]"
            parts.append(f"{name} {t} {text}")
    return f"{lead} {'NOT MET' if short else 'MET'} ({'; '.join(parts)})"


def _best_tile(r: dict) -> tuple[str, float] | None:
    """The fastest shape that kept the bits, as (name, speedup vs torch._grouped_mm)."""
    bf16, ok = r.get("bf16_torch_ms"), r.get("tile_bitwise_equal") or {}
    timed = {k: v for k, v in (r.get("tile_ms") or {}).items() if v and ok.get(k)}
    if not timed or not bf16 or r.get("bf16_torch_impl") != "torch._grouped_mm":
        return None
    name = min(timed, key=timed.get)
    return name, bf16 / timed[name]


COLUMNS = (
    "model", "tokens", "mode", "tile", "ours_ms", "vllm_fp8_ms", "bf16_vllm_ms", "bf16_torch_ms",
    "speedup", "vllm_fp8_speedup", "ours_vs_vllm_fp8", "bar", "err_ours", "err_vllm_fp8",
    "bitwise_equal",
)  # fmt: skip


def tile_choice(shape: MoeShape, tokens: int) -> str:
    """The grouped GEMM shape ours runs at ``tokens`` (both GEMMs see ``tokens * top_k`` rows)."""
    from nemo_jetrl.fp8.grouped_tiles import ROWS_TILES, rows_tile

    name = rows_tile(tokens * shape.top_k, shape.experts)
    return f"{name} ({ROWS_TILES[name].label})"


def forced_tile(fn: Callable[[], torch.Tensor], name: str) -> Callable[[], torch.Tensor]:
    """``fn`` run with the grouped GEMM's shape forced to ``name`` (read at each launch)."""
    from nemo_jetrl.fp8.grouped_tiles import ENV_ROWS_TILE

    def run() -> torch.Tensor:
        saved = os.environ.get(ENV_ROWS_TILE)
        os.environ[ENV_ROWS_TILE] = name
        try:
            return fn()
        finally:
            if saved is None:
                os.environ.pop(ENV_ROWS_TILE, None)
            else:
                os.environ[ENV_ROWS_TILE] = saved

    return run


def record(rows: list[dict], device: str, args: argparse.Namespace, skipped: list[str]) -> dict:
    return {
        "benchmark": "bench_moe_layer", "version": RECORD_VERSION, "device": device,
        "bar": {"model": BAR_MODEL, "min_speedup": BAR_SPEEDUP, "summary": bar_summary(rows)},
        "target": {"tokens": list(TARGET_TOKENS), "summary": target_summary(rows)},
        "prefill_target": {
            "models": list(PREFILL_MODELS), "tokens": list(PREFILL_TOKENS),
            "summary": prefill_summary(rows),
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "skipped": skipped, "rows": rows,
    }  # fmt: skip
