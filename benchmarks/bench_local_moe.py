"""The tiny Qwen3-MoE example per recipe, with and without routing replay: per-step
token_mult_prob_error, gen_kl_error, jetrl/moe/routing_mismatch, reward and the median step time
(docs/moe.md "Measured").

    .venv/bin/python benchmarks/bench_local_moe.py [--steps 8] [--skew 0.01] [--out moe.json]

Each run is `run_local` on ``examples/configs/local/moe/<recipe>.yaml`` (150-step warm start,
cached; 8 prompts x 4 samples; no validation). ``--skew S`` instead runs jetrl with the
rollout's router weight skewed by ``S * N(0, 1)`` at every refit (a planted routing divergence),
replay off and on. Step times on a shared machine measure the other tenants too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "configs" / "local" / "moe"
RUNS = (
    ("bf16", False),
    ("fp8_rollout", False),
    ("fp8_rollout", True),
    ("jetrl", False),
    ("jetrl", True),
    ("jetrl_kv", False),
)
ROUTER = "model.layers.1.mlp.gate.weight"
TAGS = ("train/token_mult_prob_error", "train/gen_kl_error", "jetrl/moe/routing_mismatch")


def _skew_hook(scale: float):
    import torch

    from nemo_jetrl.backends.local.loop import Hooks

    def skew(_step: int, weights: dict) -> dict:
        g = torch.Generator().manual_seed(0)
        w = weights[ROUTER]
        weights[ROUTER] = w + torch.randn(w.shape, generator=g).to(w.dtype) * scale
        return weights

    return Hooks(before_refit=skew)


def run_one(recipe: str, replay: bool, steps: int, work: Path, hooks=None) -> dict:
    from nemo_jetrl.backends.local.loop import resolve_run, run_local
    from nemo_jetrl.config import load_config

    cfg = load_config(
        EXAMPLE / f"{recipe}.yaml",
        [
            f"grpo.max_num_steps={steps}",
            "grpo.val_period=0",
            "grpo.val_at_start=false",
            f"jetrl.local.model_config={EXAMPLE / 'qwen3_moe_tiny.json'}",
            f"logger.log_dir={work / f'{recipe}_replay{int(replay)}'}",
            f"policy.router_replay.enabled={str(replay).lower()}",
        ],
    )
    t0 = time.perf_counter()
    hist = run_local(resolve_run(cfg), progress=False, log=lambda *_: None, hooks=hooks).history
    row = {tag: [h[tag] for h in hist] for tag in TAGS}
    row["train/reward"] = [h["train/reward"] for h in hist]
    row["median_step_s"] = statistics.median(h["timing/train/total_step_time"] for h in hist)
    row["wall_s"] = time.perf_counter() - t0
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skew", type=float, default=None)
    p.add_argument("--work", type=Path, default=Path("bench_local_moe_runs"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    runs = [("jetrl", False), ("jetrl", True)] if args.skew is not None else RUNS
    hooks = _skew_hook(args.skew) if args.skew is not None else None
    out = {}
    for recipe, replay in runs:
        row = run_one(recipe, replay, args.steps, args.work, hooks)
        out[f"{recipe} replay={'on' if replay else 'off'}"] = row
        shown = {
            k: [round(v, 7) for v in vals] for k, vals in row.items() if isinstance(vals, list)
        }
        print(f"{recipe} replay={replay}: {json.dumps(shown)} median step "
              f"{row['median_step_s']:.2f} s", flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
