"""What does the refit rollback cost next to the refit's own copy into the model?

`nemo_jetrl.vllm_patch.rollback` snapshots the engine's model before every refit (one copy of its
tensors) and, only when the refit fails, restores it and checks it bit for bit. Measured in one
run on one model (a HF Llama built from its config, random weights: timing does not depend on
values), medians of ``--repeats`` runs:

* ``load``: ``model.load_state_dict`` of another state dict: the copy every refit does anyway
  (the lower bound of a refit, without transport or quantization);
* ``snapshot``: `take_snapshot` (paid on every refit);
* ``restore``: `restore_snapshot` after a half load, verification included (paid on failure only).

Ratios ``snapshot/load`` and ``restore/load`` are printed with the bytes a snapshot holds.
On CPU this measures host memcpy; with ``--device cuda`` the snapshot stays on the GPU (it fits)
and CUDA is synchronized around each timed call.

    .venv/bin/python benchmarks/bench_refit_rollback.py [--hidden 1024 --layers 8] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def _timed(fn, device: str) -> tuple[float, object]:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args(argv)

    import torch
    import transformers

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_refit_rollback: --device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from nemo_jetrl.vllm_patch.rollback import restore_snapshot, take_snapshot

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 512),
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).to(args.device)
    other = {k: v.clone().normal_() for k, v in model.state_dict().items()}
    half = dict(list(other.items())[: len(other) // 2])
    times: dict[str, list[float]] = {"load": [], "snapshot": [], "restore": []}
    nbytes = 0
    with torch.no_grad():
        for _ in range(args.repeats):
            t, _ = _timed(lambda: model.load_state_dict(other), args.device)
            times["load"].append(t)
            t, snap = _timed(lambda: take_snapshot(model), args.device)
            times["snapshot"].append(t)
            nbytes = snap.nbytes
            model.load_state_dict(half, strict=False)
            t, _ = _timed(lambda s=snap: restore_snapshot(model, s), args.device)
            times["restore"].append(t)
            del snap
    med = {k: statistics.median(v) for k, v in times.items()}
    params = sum(t.numel() for t in model.parameters())
    print(
        f"model: Llama hidden {args.hidden}, {args.layers} layers, {params / 1e6:.0f}M params bf16, "
        f"device {args.device}; snapshot holds {nbytes / 2**20:.0f} MiB"
    )
    print(f"{'what':<10}{'median_ms':>12}{'x load':>10}")
    for k, v in med.items():
        print(f"{k:<10}{v * 1e3:>12.1f}{v / med['load']:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
