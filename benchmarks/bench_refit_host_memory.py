"""Peak host memory of a refit with the parity check on, in the vLLM worker, per model byte.

The NeMo-RL refit hook (`nemo_jetrl.backends.nemo_rl.vllm_refit`) runs inside vLLM's worker:
each streamed batch goes through `refit_batches.quantize_batch` into the model, and with
``jetrl.refit_parity_check`` `check_refit_parity` reads everything back and compares it. This
runs exactly those two functions in the worker of a real vLLM CPU engine (jetrl recipe; loading
through vLLM's layerwise reload, as ``jetrl_load_weights`` does), twice: parity off, then on. It
reports the worker's peak RSS above its RSS before the refit (``VmHWM``, reset through
``/proc/self/clear_refs``), divided by the model's BF16 checkpoint bytes. The trainer's state
dict is loaded in the worker before the baseline, so it is not counted. glibc is told to serve
allocations >= 64 KiB with mmap (``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the RSS
and the two runs do not share reused heap.

    .venv-vllm/bin/python benchmarks/bench_refit_host_memory.py [--hidden 1024 --layers 4]
    PYTHONPATH=<checkout of other code> .venv-vllm/bin/python benchmarks/...   # compare code

Measured on the 2-core AMX Xeon, vLLM 0.32.0 CPU build, default model (Llama hidden 1024,
4 layers, vocab 32000: 252 MB BF16), peak RSS above baseline / model bytes:

    code                                            parity off  parity on  parity's share
    dc4b824 (2 copies sent, read-back + pack/unpack)      1.26       5.37       4.12 (1040 MB)
    streamed comparison (issue 29)                        1.26       2.15       0.89 (225 MB)

The remaining share is the one host copy of what was sent (FP8 weights, BF16 embedding, lm_head
and norms: 0.76x here) plus the tensor being compared. "parity off" is the load itself (the
quantizer's output and vLLM's layerwise reload).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _measure(worker, model_dir: str, parity: bool, batch_bytes: int) -> dict:  # in the worker
    import gc

    import nemo_jetrl
    from nemo_jetrl.backends.nemo_rl.refit_batches import (
        SentTensors,
        check_refit_parity,
        quantize_batch,
    )
    from nemo_jetrl.vllm_patch import compat
    from nemo_jetrl.vllm_patch.refit import load_hf_state_dict
    from nemo_jetrl.vllm_patch.settings import ENV_VAR, PatchSettings

    def status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    w = getattr(worker, "worker", worker)
    settings = PatchSettings.from_json(os.environ[ENV_VAR])
    weights = load_hf_state_dict(model_dir)  # the trainer's tensors: held before and after
    batches, batch, held = [], [], 0
    for name, t in weights.items():  # NeMo-RL streams batches of about this many bytes
        batch.append((name, t))
        held += t.numel() * t.element_size()
        if held >= batch_bytes:
            batches.append(batch)
            batch, held = [], 0
    batches.append(batch)
    gc.collect()
    rss0 = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    sent = SentTensors(keep=parity)
    model = w.model_runner.model
    stream = (t for b in batches for t in quantize_batch(b, model, settings, sent))
    compat.reload_weights(model, w.vllm_config.model_config, stream)
    report = check_refit_parity(w, sent) if parity else None
    peak = status("VmHWM")
    del sent, stream
    gc.collect()
    return {
        "peak": peak - rss0,
        "model": sum(t.numel() * t.element_size() for t in weights.values()),
        "compared": None if report is None else report.compared,
        "code": str(Path(nemo_jetrl.__file__).parent),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch-mb", type=int, default=64, help="bytes per streamed batch, MiB")
    args = p.parse_args(argv)
    try:
        import vllm
    except ImportError:
        print("bench_refit_host_memory: needs vLLM (.venv-vllm/bin/python)", file=sys.stderr)
        return 2
    import torch
    import transformers

    sys.path.insert(0, str(REPO / "tests"))  # the vLLM tests' character tokenizer
    from hf_models import char_tokenizer

    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch.compat import cpu_omp_threads_bind
    from nemo_jetrl.vllm_patch.engine import VllmRolloutEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_omp_threads_bind())
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # _measure is sent by value
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed tensors leave the RSS (docstring)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 512),
        head_dim=128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(d)
        char_tokenizer().save_pretrained(d)
        kwargs = dict(dtype="bfloat16", max_model_len=128, max_num_seqs=4, enforce_eager=True)
        with VllmRolloutEngine(
            d, Recipe.preset("jetrl"), engine_kwargs=kwargs, initial_refit=False
        ) as eng:
            rows = {
                parity: eng.llm.collective_rpc(_measure, args=(d, parity, args.batch_mb << 20))[0]
                for parity in (False, True)
            }
    model = rows[True]["model"]
    print(
        f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
        f"{model / 1e6:.0f} MB BF16; vLLM {vllm.__version__}; code {rows[True]['code']}"
    )
    print(f"{'parity':<8}{'peak_MB':>10}{'peak/model':>12}")
    for parity, r in rows.items():
        print(f"{'on' if parity else 'off':<8}{r['peak'] / 1e6:>10.0f}{r['peak'] / model:>12.2f}")
    extra = rows[True]["peak"] - rows[False]["peak"]
    print(f"parity's share: {extra / 1e6:.0f} MB = {extra / model:.2f} x model bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
