"""How much faster is FP8 rollout? vLLM offline generation tokens/s, FP8 vs BF16.

The Jet-RL Table 4 setting: 512 prompts of 512 random tokens, at most 128 sequences in flight,
every response forced to exactly 4K / 8K / 16K tokens (``ignore_eos``), for four rollout setups:

* ``bf16``      BF16 weights and activations, BF16 KV cache (the baseline);
* ``bf16_kv``   BF16 linears, FP8 KV cache;
* ``jetrl``     FP8 blockwise linears through our vLLM patch (weights refit from the checkpoint
                by the trainer-side quantizer, activations by our Triton kernel), BF16 KV cache;
* ``jetrl_kv``  the same plus an FP8 KV cache.

Each (setup, length) runs in a fresh subprocess (a vLLM engine does not release GPU memory
reliably), started with ``nemo_jetrl.vllm_patch.build_engine_kwargs(Recipe.preset(name))`` and,
for FP8 setups, ``apply_patches`` and a refit from ``--model``'s safetensors. Throughput is
generated tokens / wall time of ``LLM.generate``; ``speedup`` divides by the ``bf16`` row of the
same length. KV scales are vLLM's defaults (1.0) here: speed does not depend on their values.

Usage: python benchmarks/gpu/bench_vllm_generation.py --model /path/to/Qwen3-8B-Base
         [--output-lens 4096 8192 16384] [--setups bf16 bf16_kv jetrl jetrl_kv]
         [--num-prompts 512] [--concurrency 128] [--input-len 512]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import _common

SETUPS = ("bf16", "bf16_kv", "jetrl", "jetrl_kv")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen/Qwen3-8B-Base", help="local HF dir or hub id")
    ap.add_argument("--output-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=128, help="vLLM max_num_seqs")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument(
        "--warmup-tokens",
        type=int,
        default=64,
        help="tokens per sequence of the untimed warm-up generate (max_num_seqs sequences)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--setup", default="bf16", help=argparse.SUPPRESS)
    ap.add_argument("--output-len", type=int, default=4096, help=argparse.SUPPRESS)
    return ap


def recipe_for(setup: str):
    """The Recipe of a setup name (presets; ``bf16_kv`` is bf16 with an FP8 KV cache)."""
    from nemo_jetrl.recipe import Recipe

    if setup == "bf16_kv":
        return Recipe.preset("bf16").with_(kv_cache_dtype="fp8", kv_scale_source="unit")
    return Recipe.preset(setup)


def model_dir(model: str) -> Path:
    """A local directory with config.json and *.safetensors (downloads a hub id once)."""
    p = Path(model)
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    )


def worker(args: argparse.Namespace) -> dict:
    """One engine, one generate call; returns the measurements."""
    from nemo_jetrl._optional import require

    require("vllm", feature="bench_vllm_generation")
    import torch
    from vllm import LLM, SamplingParams

    from nemo_jetrl.arch import resolve_arch
    from nemo_jetrl.vllm_patch import apply_patches, build_engine_kwargs
    from nemo_jetrl.vllm_patch.refit import refit_from_checkpoint

    path = model_dir(args.model)
    arch = resolve_arch(str(path))
    recipe = recipe_for(args.setup)
    user = {
        "max_num_seqs": args.concurrency,
        "max_model_len": args.input_len + args.output_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_prefix_caching": False,
        "seed": 0,
    }
    ek = build_engine_kwargs(recipe, user, num_layers=arch.num_layers)
    handle = None
    if ek.settings.fp8_weights or ek.settings.fp8_kv_cache:
        handle = apply_patches(recipe, num_layers=arch.num_layers)
    try:
        llm = LLM(model=str(path), **ek.kwargs)
        refit_s = 0.0
        if ek.kwargs.get("load_format") == "dummy":
            refit_s = refit_from_checkpoint(llm, path, recipe).seconds
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(
            1000, arch.vocab_size - 1000, (args.num_prompts, args.input_len), generator=g
        )
        prompts = [{"prompt_token_ids": row.tolist()} for row in ids]
        sp = SamplingParams(
            max_tokens=args.output_len,
            min_tokens=args.output_len,
            ignore_eos=True,
            temperature=1.0,
            seed=0,
        )
        # Warm-up generate: kernels JIT-compiled or autotuned on first use (DeepGEMM, Triton,
        # torch.compile graphs per batch size) are paid here, not inside the timed call.
        warm = SamplingParams(max_tokens=args.warmup_tokens, temperature=1.0, seed=1)
        llm.generate(prompts[: args.concurrency], warm, use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
    finally:
        if handle is not None:
            handle.revert()
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "setup": args.setup,
        "linears": "fp8" if ek.settings.fp8_weights else "bf16",
        "kv_cache": ek.settings.kv_cache_dtype,
        "out_len": args.output_len,
        "prompts": args.num_prompts,
        "concurrency": args.concurrency,
        "gen_tokens": gen,
        "seconds": seconds,
        "tok/s": gen / seconds,
        "refit_s": refit_s,
    }


def run_one(args: argparse.Namespace, setup: str, out_len: int) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--setup",
        setup,
        "--output-len",
        str(out_len),
        "--model",
        args.model,
        "--num-prompts",
        str(args.num_prompts),
        "--concurrency",
        str(args.concurrency),
        "--input-len",
        str(args.input_len),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
        "--warmup-tokens",
        str(args.warmup_tokens),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        return {"setup": setup, "out_len": out_len, "error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


COLUMNS = (
    "setup",
    "linears",
    "kv_cache",
    "out_len",
    "prompts",
    "concurrency",
    "gen_tokens",
    "seconds",
    "tok/s",
    "speedup",
    "refit_s",
)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _common.require_cuda("bench_vllm_generation")
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    print(f"# {_common.gpu_name()}; model {args.model}")
    rows, errors = [], []
    for out_len in args.output_lens:
        base = None
        for setup in args.setups:
            r = run_one(args, setup, out_len)
            if "error" in r:
                errors.append(r)
                continue
            if setup == "bf16":
                base = r["tok/s"]
            r["speedup"] = r["tok/s"] / base if base else "n/a"
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)  # progress
    _common.print_table(rows, COLUMNS)
    for e in errors:
        print(f"FAILED {e['setup']} out_len={e['out_len']}: {e['error']}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
